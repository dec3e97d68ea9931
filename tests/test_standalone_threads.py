"""One `KVTier` shared by several threads (issue 30): every call returns, every byte is right,
and `close()` from one thread ends the others' calls with `ClosedError`."""

from __future__ import annotations

import random
import threading

import pytest
from test_manager import HungHandler
from test_standalone import keys as std_keys
from test_standalone import make_kv

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CPULoadStoreSpec,
    load_config_text,
    make_offload_key,
)
from kvtier.core.errors import ClosedError
from kvtier.standalone import KVTier

torch = pytest.importorskip("torch")

PAGE = 4096
THREADS, SPAN = 6, 40  # each thread owns engine blocks [w * SPAN, (w + 1) * SPAN)
WATCHDOG_S = 60  # a run takes a few seconds; past this the threads are taken to be hung


def open_tier(tmp_path, num_blocks=256):
    tensor = torch.zeros((num_blocks, PAGE), dtype=torch.int8)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, PAGE)], [[CanonicalKVCacheRef(0, PAGE)]])
    cfg = load_config_text(f"""
tiers:
  - {{name: cpu, backend: cpu, capacity: 32 blocks, pin: false}}
  - {{name: nvme, backend: file, root_dir: {tmp_path / 'nvme'}, capacity: 1024 blocks}}
""")
    return KVTier.open(cfg, kv, model="test/threads"), tensor


def run_threads(target, count=THREADS):
    """Run `target(w)` on `count` threads; the exceptions they raised, by thread. Fails (instead
    of hanging the suite) when a thread is still running after `WATCHDOG_S`."""
    errors: dict[int, BaseException] = {}

    def body(w):
        try:
            target(w)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[w] = exc

    threads = [threading.Thread(target=body, args=(w,), daemon=True) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    hung = [w for w, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"threads {hung} still blocked after {WATCHDOG_S} s (a call waits forever)"
    return errors


def test_threads_store_and_load_their_own_blocks_byte_exact(tmp_path):
    tier, tensor = open_tier(tmp_path)
    rounds, per_round = 100, 4
    wrong: list[str] = []

    def worker(w):
        rng = random.Random(w)
        src, dst = w * SPAN, w * SPAN + per_round
        for r in range(rounds):
            keys = [make_offload_key(bytes([w, r, i]) * 8, 0) for i in range(per_round)]
            for i in range(per_round):  # this round's content: a value per (thread, round, key)
                tensor[src + i].fill_((w * 31 + r * 7 + i) % 256 - 128)
            expected = tensor[src:src + per_round].clone()
            assert tier.store(keys, list(range(src, src + per_round)))
            if rng.random() < 0.5:
                threading.Event().wait(rng.random() * 0.003)
            tensor[dst:dst + per_round].zero_()
            n = tier.load(keys, list(range(dst, dst + per_round)))
            if n != per_round or not torch.equal(tensor[dst:dst + per_round], expected):
                wrong.append(f"thread {w} round {r}: loaded {n}/{per_round}, bytes equal: "
                             f"{torch.equal(tensor[dst:dst + n], expected[:n])}")

    try:
        errors = run_threads(worker)
        assert not errors, errors
        assert not wrong, wrong[:5]
        stats = tier.stats()["engine"]
        assert stats["loads"] >= THREADS * rounds and stats["store_failures"] == stats["load_failures"] == 0
    finally:
        tier.close()


def test_close_from_another_thread_ends_the_others_calls_with_closed_error(tmp_path):
    tier, tensor = open_tier(tmp_path)
    started = threading.Barrier(THREADS + 1)

    def worker(w):
        started.wait()
        src = w * SPAN
        for r in range(100000):  # until closed
            keys = [make_offload_key(bytes([w, r % 256, r // 256, i]) * 4, 0) for i in range(4)]
            tier.store(keys, list(range(src, src + 4)))
            tier.load(keys, list(range(src + 4, src + 8)))

    closer = threading.Thread(target=lambda: (started.wait(), threading.Event().wait(0.3), tier.close()))
    closer.start()
    errors = run_threads(worker)
    closer.join(WATCHDOG_S)
    assert not closer.is_alive()
    assert sorted(errors) == list(range(THREADS))
    assert all(isinstance(e, ClosedError) for e in errors.values()), errors
    with pytest.raises(ClosedError):
        tier.lookup([make_offload_key(b"x" * 16, 0)])


def test_close_ends_a_flush_waiting_for_copies_in_another_thread():
    """A `flush()` (no timeout) waiting for a cascade copy that does not end held the call lock,
    so `close()` from another thread waited as long; now the flush ends with `ClosedError`."""
    tier = KVTier.open(load_config_text("tiers:\n  - {name: hot, backend: cpu, capacity: 8 blocks, pin: false, "
                                        "cascade: on_store}\n  - {name: warm, backend: memory, capacity: 8 blocks}\n"),
                       make_kv())
    hung = HungHandler()
    tier.hierarchy.router.register(CPULoadStoreSpec, CPULoadStoreSpec, hung)
    assert tier.store(std_keys(2), [0, 1])
    outcome: dict[str, BaseException | int] = {}
    flusher = threading.Thread(target=lambda: outcome.update(flush=_call(tier.flush)), daemon=True)
    flusher.start()
    while not hung.jobs:  # the copy below has started and will not end
        threading.Event().wait(0.01)
    closer = threading.Thread(target=lambda: tier.close(flush=False), daemon=True)
    closer.start()
    flusher.join(WATCHDOG_S / 20)
    ended = not flusher.is_alive()
    hung.finish_all()  # let close() (and, before the fix, the flush) finish either way
    flusher.join(WATCHDOG_S)
    closer.join(WATCHDOG_S)
    assert ended, "flush() still waiting for its copies after close() was called"
    assert isinstance(outcome["flush"], ClosedError), outcome
    assert not closer.is_alive()


def _call(fn):
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
