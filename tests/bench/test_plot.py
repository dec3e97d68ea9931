"""The hop plot labels block sizes in human units (64KiB, 1MiB), not as powers of two."""

from __future__ import annotations

import pytest

from kvtier.bench.plot import plot_bench

matplotlib = pytest.importorskip("matplotlib")


def test_block_sizes_are_labelled_in_human_units(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    real_subplots = plt.subplots

    def subplots(*args, **kwargs):  # the figure `plot_bench` draws, kept to read its axes afterwards
        made.append(real_subplots(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plt, "subplots", subplots)
    rows = [{"hop": "CPU->FILE", "block_bytes": b, "gbps": 1.0, "baseline": "raw", "baseline_gbps": 2.0}
            for b in (64 << 10, 1 << 20, 8 << 20)]
    plot_bench({"hops": rows}, tmp_path / "bench.png")
    (_, axes), = made
    ax, = axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64KiB", "1MiB", "8MiB"]
    assert ax.get_xlabel() == "block size"
    assert (tmp_path / "bench.png").stat().st_size > 0
