"""A later engine of the same model identity whose YAML asks for other tiers is refused at hello,
naming the setting that differs and both values: every field and option of every tier counts.

Before: only each tier's name, backend, capacity and policy were compared, so another file tier
`root_dir` (the engine then read the first engine's directory and its own was never created),
another `cascade`, or another valkey `url` / `key_prefix` was accepted without a word."""

from __future__ import annotations

import copy
import os
import re
import uuid

import pytest
from host.test_host_owner import client, owner  # noqa: F401  (the owner fixture)
from host.test_host_standalone import keys, make_kv, same_blocks, wipe

from kvtier import load_config_text
from kvtier.host.client import HostRefused
from kvtier.standalone import KVTier


def greeting(tmp_path, model):
    return {"identity": {"model": model, "block_bytes": 4096, "block_tokens": 16},
            "config": {"tiers": [
                {"name": "cpu", "backend": "cpu", "capacity": "8 blocks"},
                {"name": "nvme", "backend": "file", "root_dir": str(tmp_path / "a"), "capacity": "64 blocks"},
                {"name": "far", "backend": "valkey", "capacity": "100 blocks", "url": "redis://127.0.0.1:1",
                 "key_prefix": "kvt:a"}]}}


def changed(base, tier, **settings):
    other = copy.deepcopy(base)
    other["config"]["tiers"][tier].update(settings)
    return other


@pytest.mark.parametrize(("tier", "setting", "value", "held"), [
    (1, "root_dir", "{tmp}/b", "'{tmp}/a/host-"),
    (0, "cascade", "none", "'on_evict'"),
    (1, "cascade", "none", "'on_evict'"),  # (the last local tier: on_store there is refused, having no effect)
    (0, "reserve", 0.5, "0.1"),
    (1, "sync_interval", 5.0, "1.0"),
    (2, "url", "redis://127.0.0.1:2", "'redis://127.0.0.1:1'"),
    (2, "key_prefix", "kvt:b", "'kvt:a'"),
])
def test_an_engine_asking_for_another_tier_setting_is_refused_naming_both(tmp_path, owner,  # noqa: F811
                                                                         tier, setting, value, held):
    base = greeting(tmp_path, f"m-{uuid.uuid4().hex[:8]}")
    client(owner, base).connect()
    value = value.format(tmp=tmp_path) if isinstance(value, str) else value
    path = f"tiers[{tier}].{setting}"
    with pytest.raises(HostRefused) as refused:
        client(owner, changed(base, tier, **{setting: value})).connect()
    message = str(refused.value)
    assert f"{path}: the host namespace" in message
    assert f"already has {path}={held.format(tmp=tmp_path)}" in message
    assert re.search(f"this engine asks for {re.escape(path)}=.*{re.escape(str(value))}", message)
    assert not os.path.exists(tmp_path / "b")  # (another root_dir is never created)


def test_another_number_of_tiers_is_refused(tmp_path, owner):  # noqa: F811
    base = greeting(tmp_path, f"m-{uuid.uuid4().hex[:8]}")
    client(owner, base).connect()
    fewer = copy.deepcopy(base)
    del fewer["config"]["tiers"][2]
    with pytest.raises(HostRefused, match=r"tiers: .* already has tiers=3; this engine asks for tiers=2"):
        client(owner, fewer).connect()


def test_the_same_tiers_spelled_otherwise_are_accepted(tmp_path, owner):  # noqa: F811
    """Defaults written out, a capacity in other words: the settings the owner reads are the same."""
    base = greeting(tmp_path, f"m-{uuid.uuid4().hex[:8]}")
    client(owner, base).connect()
    same = changed(changed(base, 0, cascade="on_evict", reserve=0.1, policy="prefix-freq"), 2, key_prefix="kvt:a",
                   threads=4)
    assert client(owner, same).connect()["num_blocks"] == 8


def test_a_standalone_engine_with_another_root_dir_is_refused_and_the_first_one_still_served(tmp_path):
    from host.owner_process import OwnerProcess

    owner_process = OwnerProcess(f"{tmp_path}/run/host.sock", tmp_path / "owner.log").start()
    try:
        def config(root):
            return load_config_text(f"""
shared: {{scope: host, socket: {tmp_path}/run/host.sock, timeout_ms: 200}}
tiers:
  - {{name: cpu, backend: cpu, capacity: 8 blocks}}
  - {{name: nvme, backend: file, root_dir: {tmp_path}/{root}, capacity: 64 blocks}}
""")
        a_kv, b_kv = make_kv(seed=1), make_kv(seed=9)
        with KVTier.open(config("a"), a_kv, model="m") as a:
            assert a.store(keys(4), list(range(4)))
            with pytest.raises(HostRefused, match=r"tiers\[1\]\.root_dir: .*/a/host-.*asks for .*/b/host-"):
                KVTier.open(config("b"), b_kv, model="m")
            assert not os.path.exists(tmp_path / "b")
            wipe(b_kv)
            with KVTier.open(config("a"), b_kv, model="m") as b:
                assert b.load(keys(4), list(range(4))) == 4
            assert same_blocks(a_kv, b_kv, 4)
    finally:
        owner_process.stop()
