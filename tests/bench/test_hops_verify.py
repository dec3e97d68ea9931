"""Engine <-> CPU hop rows are byte-verified: a handler that corrupts bytes is an error, not a figure."""

from __future__ import annotations

import pytest

from kvtier.bench.hops import TransferCorrupted, measure_gpu_cpu
from kvtier.cli.main import main

pytest.importorskip("torch")


class _Corrupting:
    """Wraps a real GPU<->CPU handler; flips a byte of CPU slot 0 after each store completes."""

    def __init__(self, inner, tier):
        self.inner, self.tier = inner, tier

    def bind(self, callback):
        def done(result):
            self.tier.view(0)[0] ^= 0xFF
            callback(result)
        self.inner.bind(done)

    def submit(self, *args):
        return self.inner.submit(*args)

    def shutdown(self):
        self.inner.shutdown()


@pytest.fixture
def corrupting_store(monkeypatch):
    import kvtier.transfer.handlers.gpu_cpu as gpu_cpu

    real = gpu_cpu.make_handler

    def make(tiers, kv, to_cpu):
        handler = real(tiers, kv, to_cpu=to_cpu)
        return _Corrupting(handler, tiers["bench"]) if to_cpu else handler

    monkeypatch.setattr(gpu_cpu, "make_handler", make)


@pytest.mark.parametrize("order", ["consecutive", "scattered"])
def test_every_block_is_compared_after_measuring(order):
    rows = measure_gpu_cpu("cpu", [64 << 10], 1 << 20, repeats=1, slot_orders=[order])
    assert [(r["hop"], r["slots"], r["verified"]) for r in rows] == [("GPU->CPU", order, True),
                                                                      ("CPU->GPU", order, True)]


def test_a_store_that_corrupts_a_block_raises(corrupting_store):
    with pytest.raises(TransferCorrupted, match="GPU->CPU \\(consecutive slots\\) with 65536-byte blocks moved "
                                                "wrong bytes"):
        measure_gpu_cpu("cpu", [64 << 10], 1 << 20, repeats=1, slot_orders=["consecutive"])


def test_the_command_exits_1_without_figures(corrupting_store, tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["bench", "hops", "--config", "configs/memory.yaml", "--block-sizes", "64KiB", "--repeats", "1",
            "--root-dir", str(tmp_path), "--json", str(out), "--no-progress"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "kvtier: error: GPU->CPU (consecutive slots)" in captured.err and "Summary" not in captured.out
    assert not out.exists()  # the writability check leaves no empty file; the JSON is never written


def test_a_failed_check_still_shuts_both_handlers_down(monkeypatch):
    """Before, the handlers were shut down only after every check passed: a corrupting transfer
    left them running (on CUDA: two worker threads and a stream each)."""
    import kvtier.transfer.handlers.gpu_cpu as gpu_cpu

    real, shut = gpu_cpu.make_handler, []

    class Recorded(_Corrupting):
        def __init__(self, inner, tier, to_cpu):
            super().__init__(inner, tier)
            self.to_cpu = to_cpu

        def bind(self, callback):
            if self.to_cpu:
                super().bind(callback)
            else:
                self.inner.bind(callback)

        def shutdown(self):
            shut.append("store" if self.to_cpu else "load")
            super().shutdown()

    monkeypatch.setattr(gpu_cpu, "make_handler",
                        lambda tiers, kv, to_cpu: Recorded(real(tiers, kv, to_cpu=to_cpu), tiers["bench"], to_cpu))
    with pytest.raises(TransferCorrupted):
        measure_gpu_cpu("cpu", [64 << 10], 1 << 20, repeats=1, slot_orders=["consecutive"])
    assert sorted(shut) == ["load", "store"]
