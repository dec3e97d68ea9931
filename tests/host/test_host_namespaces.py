"""The owner's namespaces are bounded: at most `max_namespaces` model identities at once, and one
that no engine has used for `idle_namespace_s` is closed (its CPU tier written down, its region
freed), never while an engine is connected; an engine of that model later finds its file tier's
blocks again in a new namespace."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from host.test_host_standalone import keys, make_kv, same_blocks, shared_config

from kvtier.host.client import HostRefused
from kvtier.host.owner import IDLE_CHECK_S, HostOwner
from kvtier.standalone import KVTier

IDLE_S = 0.3


@pytest.fixture
def owner(tmp_path):
    owner = HostOwner(str(tmp_path / "run" / "host.sock"), idle_namespace_s=IDLE_S, max_namespaces=1,
                      flush_timeout=5)
    yield owner
    owner.close()


def model():
    return f"test-model-{uuid.uuid4().hex[:8]}"


def wait_for(condition, timeout=IDLE_S + 4 * IDLE_CHECK_S):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_idle_namespace_is_closed_and_its_file_tier_found_again(tmp_path, owner):
    name, config, kv = model(), shared_config(tmp_path), make_kv(seed=1)
    with KVTier.open(config, kv, model=name) as a:
        assert a.store(keys(4), list(range(4)))
        region = f"/dev/shm/{a.client.region['shm_name']}"
        assert os.path.exists(region)
    wait_for(lambda: not owner.namespaces)
    assert not os.path.exists(region)  # (its memory is back once no engine maps it)
    other = make_kv(seed=9)
    with KVTier.open(config, other, model=name) as b:
        assert b.client.region["shm_name"] == os.path.basename(region)  # (a new region of the same name)
        assert b.load(keys(4), list(range(4))) == 4  # written down at the close, found again below
        assert same_blocks(kv, other, 4)


def test_a_namespace_with_an_engine_connected_is_never_closed(tmp_path, owner):
    name, kv = model(), make_kv(seed=1)
    with KVTier.open(shared_config(tmp_path, file_tier=False), kv, model=name) as a:
        assert a.store(keys(3), list(range(3)))
        time.sleep(IDLE_S + 2 * IDLE_CHECK_S)  # (an engine with nothing to do, still connected)
        assert len(owner.namespaces) == 1
        assert a.lookup(keys(3)) == 3


def test_one_model_too_many_is_refused_until_an_idle_one_closes(tmp_path, owner):
    config, first = shared_config(tmp_path, file_tier=False), model()
    a = KVTier.open(config, make_kv(seed=1), model=first)
    try:
        with pytest.raises(HostRefused, match=r"at most 1 model identities at once \(kvtier serve --max-namespaces\)"):
            KVTier.open(config, make_kv(seed=2), model=model())
    finally:
        a.close()
    wait_for(lambda: not owner.namespaces)
    with KVTier.open(config, make_kv(seed=2), model=model()) as b:
        assert b.store(keys(2), [0, 1])
