"""Every field of a config answers a huge value at once (issue 36.7): vLLM's inline `kvtier_config`
is a dict, not a file under the 1 MiB bound, so one string value may be 50 MB. On 7e6c7c1 a 50 MB
`capacity` took 2.08-3.3 s to refuse (its regexes backtracked through it) and a `root_dir` of
slashes 2.9 s, where every other field took about 0.1 s."""

from __future__ import annotations

import copy
import time

import pytest

from kvtier import ConfigError, parse_config

BASE = {"block_tokens": 16, "store_threshold": 0, "block_bytes": "4KiB", "tiers": [
    {"name": "cpu", "backend": "cpu", "capacity": "4 blocks", "policy": "lru", "cascade": "on_evict",
     "reserve": 0.1, "pin": "auto", "shm_name": "x"},
    {"name": "nvme", "backend": "file", "capacity": "4 blocks", "root_dir": "/tmp/kvtier-x", "io": "posix",
     "fingerprint": "f", "num_threads": 2, "sync_interval": 1.0, "on_identity_change": "refuse"},
    {"name": "shared", "backend": "valkey", "capacity": "4 blocks", "url": "redis://127.0.0.1:6379",
     "username": "u", "password_env": "P", "key_prefix": "kvt", "timeout_ms": 250, "max_inflight_mib": 256,
     "breaker_failures": 3, "breaker_open_s": 5, "negative_ttl_s": 2, "threads": 4}]}
FIELDS = [(key,) for key in BASE if key != "tiers"] + [(i, key) for i, tier in enumerate(BASE["tiers"]) for key in tier]
N = 50_000_000


@pytest.mark.parametrize("shape", ["digits", "spaces then a digit", "slashes"])
def test_a_50_mb_value_in_any_field_is_answered_within_a_second(shape):
    huge = {"digits": "1" * N, "spaces then a digit": " " * N + "1", "slashes": "/" * N}[shape]
    slow = []
    for path in FIELDS:
        raw = copy.deepcopy(BASE)
        (raw if len(path) == 1 else raw["tiers"][path[0]])[path[-1]] = huge
        start = time.perf_counter()
        with pytest.raises(ConfigError) as info:
            parse_config(raw)
        took = time.perf_counter() - start
        field = path[0] if len(path) == 1 else f"tiers[{path[0]}].{path[1]}"
        assert any(p == field for p, _m in info.value.problems), (field, info.value.problems[:2])
        assert len(str(info.value)) < 2000
        if took > 1.0:
            slow.append(f"{field}: {took:.2f} s")
    assert not slow, slow


def test_a_long_capacity_says_why_and_what_would_be_right():
    raw = copy.deepcopy(BASE)
    raw["tiers"][0]["capacity"] = "1" * N
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: '1+\.\.\.1+' is too large; the largest size is "
                                          r"1048576TiB \(1 EiB\)"):
        parse_config(raw)
    raw["tiers"][0]["capacity"] = "1" * N + " blocks"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: '1+\.\.\.1+ blocks' is too many; at most "
                                          r"1000000000000 blocks"):
        parse_config(raw)
    raw["tiers"][0]["capacity"] = " " * N + "x"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: ' +\.\.\. +x' \(50000001 characters\) is too "
                                          r"long to be a size; at most 64 characters: a number and a unit, e.g. "
                                          r"'64GiB' or '10000 blocks'"):
        parse_config(raw)
