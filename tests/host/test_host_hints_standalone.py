"""Sessions' retention hints through the standalone API on `shared: host` (`SharedKVTier`) behave as
on a `KVTier` of its own: any mapping `KVTier` accepts is accepted (a mappingproxy or UserDict
hint used to raise TypeError from json and store nothing), anything else is the same
`ArgumentError` naming the field; `stats()["engine"]["retention"]` is there once a hint was given
(it was missing); a load ending the session leaves its blocks first victims (the touch after the
load used to reach the owner without the hint)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections import UserDict
from types import MappingProxyType

import pytest

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text, make_offload_key
from kvtier.core.errors import ArgumentError
from kvtier.host.owner import HostOwner
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

PAGE = 256
HINT = {"session": "chat", "retain_s": 600}


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + n)]


def kv():
    return CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(32, PAGE, dtype=torch.int8), PAGE)],
                             [[CanonicalKVCacheRef(0, PAGE)]])


@pytest.fixture
def socket_dir():
    where = tempfile.mkdtemp(prefix="kvh", dir="/tmp")  # (a socket path holds at most 107 bytes)
    owner = HostOwner(os.path.join(where, "run", "host.sock"), max_clients=4, lease_grace_s=0.3)
    yield where
    owner.close(flush_timeout=5)
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def shared(socket_dir):
    config = load_config_text(f"shared: {{scope: host, socket: {socket_dir}/run/host.sock, timeout_ms: 5000}}\n"
                              "tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n")
    with KVTier.open(config, kv(), model=f"m-{uuid.uuid4().hex[:8]}") as tier:
        yield tier


@pytest.fixture
def local():
    config = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n")
    with KVTier.open(config, kv()) as tier:
        yield tier


@pytest.mark.parametrize("wrap", [MappingProxyType, UserDict], ids=["mappingproxy", "UserDict"])
def test_a_hint_in_any_mapping_is_accepted_as_by_a_kvtier_of_its_own(shared, local, wrap):
    for tier in (local, shared):
        assert tier.store(keys(2), [0, 1], hints=wrap(HINT))
        assert tier.lookup(keys(2)) == 2
        assert tier.load(keys(2), [2, 3], hints=wrap(HINT)) == 2
        assert tier.stats()["cpu"]["retained_blocks"] == 2


@pytest.mark.parametrize("bad", [["session", "chat"], "chat", 600])
def test_a_hint_that_is_no_mapping_is_refused_as_by_a_kvtier_of_its_own(shared, local, bad):
    errors = []
    for tier in (local, shared):
        with pytest.raises(ArgumentError, match="^hints: must be a mapping") as caught:
            tier.store(keys(2), [0, 1], hints=bad)
        errors.append(str(caught.value))
        assert tier.lookup(keys(2)) == 0
    assert errors[0] == errors[1]


def test_stats_report_the_retention_once_a_hint_was_given(shared, local):
    for tier in (local, shared):
        assert "retention" not in tier.stats()["engine"]
        assert tier.store(keys(3), [0, 1, 2], hints=HINT)
        assert tier.store(keys(1, 10), [3])  # (no hint)
    mine, theirs = shared.stats()["engine"]["retention"], local.stats()["engine"]["retention"]
    assert set(mine) == set(theirs)
    for name in ("hints", "hints_refused", "sessions", "retained_blocks", "budget_blocks"):
        assert mine[name] == theirs[name], name


def test_a_load_that_ends_the_session_leaves_its_blocks_first_victims(shared, local):
    for tier in (local, shared):
        assert tier.store(keys(4), [0, 1, 2, 3], hints=HINT)
        assert tier.load(keys(4), [4, 5, 6, 7], hints={"session": "chat", "session_ended": True}) == 4
    assert shared.stats()["cpu"]["ended_blocks"] == local.stats()["cpu"]["ended_blocks"] == 4


def test_a_call_ending_the_session_counts_one_end_as_on_a_kvtier_of_its_own(shared, local):
    """A load's rounds and its touch, and a store's rounds (12 blocks through an 8-block tier), are
    the owner's calls of one API call: they end the session once, as `KVTier` counts it."""
    ended = {"session": "chat", "session_ended": True}
    for tier in (local, shared):
        assert tier.store(keys(4), [0, 1, 2, 3], hints=HINT)
        assert tier.load(keys(4), [4, 5, 6, 7], hints=ended) == 4
        assert tier.store(keys(12, 20), list(range(12)), hints={"session": "one-shot", "session_ended": True})
    assert shared.stats()["engine"]["retention"]["ended"] == local.stats()["engine"]["retention"]["ended"] == 2
