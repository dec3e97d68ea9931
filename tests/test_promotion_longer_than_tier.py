"""Loading, again and again, a run of blocks longer than the CPU tier from a tier below it that is
served by promotion into the CPU tier (a valkey tier; a file tier the worker does not load
directly, as under vLLM by default) goes at the tiers' speed every time.

Before the fix (reproduced on fc0ba84) a probe of the valkey tier, once answered, was still
waited for until its own deadline (the tier's `timeout_ms` after it was sent): every `wait_idle`
of that span, one per RETRY round of a load whose blocks come up by promotion, waited for it (the
standalone API in 0.1 s steps), so the loads that followed a probe took up to `timeout_ms` each,
and `manager.wait_idle()` took the whole `timeout_ms`. Here `timeout_ms` is 6 s and every wait,
and all the repeated loads together, must end within a quarter of it (they take milliseconds).
"""

from __future__ import annotations

import time
import uuid

import pytest

from kvtier import load_config_text
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")
pytest.importorskip("redis")

from test_nothing_lost import keys, make_kv  # noqa: E402
from test_shared_tier import Engine, content  # noqa: E402
from test_shared_tier import keys as engine_keys  # noqa: E402

TIMEOUT_MS = 6000
BOUND_S = TIMEOUT_MS / 1000 / 4  # generous: the waits below take milliseconds (a loaded 2-core machine too)
CPU_BLOCKS, RUN, LOADS = 4, 128, 3  # a run 32 times the CPU tier (32 rounds of a load), loaded three times


def _valkey(url: str, prefix: str) -> str:
    return (f"  - {{name: shared, backend: valkey, capacity: 1000 blocks, url: '{url}', key_prefix: '{prefix}', "
            f"timeout_ms: {TIMEOUT_MS}}}")


def _config(lower: str):
    return load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: {CPU_BLOCKS} blocks, pin: false}}
{lower}
""")


def _load_repeatedly(tier: KVTier, kv, ks: list[bytes]) -> list[float]:
    """Load `ks` (stored from engine blocks [0, n)) into blocks [n, 2n) `LOADS` times, checking
    the bytes each time; the seconds each load took, then those of a `wait()` after them."""
    n = len(ks)
    seconds = []
    for _ in range(LOADS):
        for t in kv.tensors:
            t.tensor[n:2 * n].zero_()
        start = time.monotonic()
        assert tier.load(ks, list(range(n, 2 * n))) == n
        seconds.append(time.monotonic() - start)
        for t in kv.tensors:
            assert torch.equal(t.tensor[n:2 * n], t.tensor[:n])
    start = time.monotonic()
    tier.wait()
    return [*seconds, time.monotonic() - start]


def test_repeated_loads_from_a_valkey_tier_found_by_probe_never_wait_for_its_deadline(valkey_server):
    prefix = f"kvt:longrun-{uuid.uuid4().hex[:8]}"
    ks = keys(RUN)
    kv = make_kv(2 * RUN)
    with KVTier.open(_config(_valkey(valkey_server.url, prefix)), kv, model="test/long-run") as writer:
        assert writer.store(ks, list(range(RUN)))
        writer.wait()
        assert writer.stats()["shared"]["publish_dropped"] == 0
    with KVTier.open(_config(_valkey(valkey_server.url, prefix)), kv, model="test/long-run") as tier:
        start = time.monotonic()
        seconds = _load_repeatedly(tier, kv, ks)
        total = time.monotonic() - start
        shared = tier.stats()["shared"]
        start = time.monotonic()
    closing = time.monotonic() - start  # (its shutdown waits for the jobs and probes in flight: none)
    assert closing < BOUND_S, f"close() took {closing:.2f} s"
    assert shared["probe_hits"] == RUN and shared["probe_timeouts"] == 0  # found once by probe, then by handle
    assert shared["promotions"] == shared["hits"] == LOADS * RUN  # every block came up through the CPU tier
    assert max(seconds) < BOUND_S, f"a load or wait() took {max(seconds):.2f} s: {seconds}"
    assert total < BOUND_S, f"{LOADS} loads of {RUN} blocks and a wait() took {total:.2f} s: {seconds}"


def test_repeated_loads_from_a_file_tier_by_promotion_never_wait(tmp_path):
    ks = keys(RUN)
    kv = make_kv(2 * RUN)
    lower = f"  - {{name: nvme, backend: file, root_dir: {tmp_path}, capacity: 512 blocks}}"
    with KVTier.open(_config(lower), kv, model="test/long-run") as tier:
        tier.manager.tiers[1].direct_load = False  # promoted into the CPU tier (vLLM's default for a file tier)
        assert tier.store(ks, list(range(RUN)))
        assert tier.flush() == 0
        seconds = _load_repeatedly(tier, kv, ks)
        stats = tier.stats()["nvme"]
    assert stats["promotions"] >= (LOADS - 1) * RUN  # (the first load finds the run's tail in the CPU tier)
    assert max(seconds) < BOUND_S and sum(seconds) < BOUND_S, seconds


def test_wait_idle_after_an_answered_probe_returns_at_once(valkey_server):
    """The control plane as an engine drives it: a second pass over a run longer than the first
    tier, whose blocks were found by a probe in the first pass, promotes them again; each
    `wait_idle()` for those promotions ends once they landed, not at the probe's deadline."""
    options = f", key_prefix: 'kvt:waits-{uuid.uuid4().hex[:8]}', timeout_ms: {TIMEOUT_MS}"
    writer = Engine(options, hot=CPU_BLOCKS, url=valkey_server.url)
    engine = Engine(options, hot=CPU_BLOCKS, url=valkey_server.url)
    try:
        ks = engine_keys(3 * CPU_BLOCKS)
        for i in range(0, len(ks), CPU_BLOCKS):
            writer.store(ks[i:i + CPU_BLOCKS])
            writer.settle()
        waits = []
        for _ in range(2):
            for i in range(0, len(ks), CPU_BLOCKS):
                window = ks[i:i + CPU_BLOCKS]
                for _ in range(10):
                    if engine.manager.lookup_run(window)[0] == len(window):
                        break
                    engine.manager.on_schedule_end()
                    start = time.monotonic()
                    engine.manager.wait_idle()
                    waits.append(time.monotonic() - start)
                assert engine.load(window) == [content(k) for k in window]
        assert engine.stats()["probes"] >= 1 and engine.stats()["probe_timeouts"] == 0
        assert max(waits) < BOUND_S, f"a wait_idle() took {max(waits):.2f} s: {waits}"
    finally:
        writer.close()
        engine.close()
