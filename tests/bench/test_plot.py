"""The hop plot labels block sizes in human units (64KiB, 1MiB), not as powers of two."""

from __future__ import annotations

import pytest

from kvtier.bench.plot import _plot_hops

matplotlib = pytest.importorskip("matplotlib")


def test_block_sizes_are_labelled_in_human_units():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"hop": "CPU->FILE", "block_bytes": b, "gbps": 1.0, "baseline": "raw", "baseline_gbps": 2.0}
            for b in (64 << 10, 1 << 20, 8 << 20)]
    fig, ax = plt.subplots()
    try:
        _plot_hops(ax, rows)
        fig.canvas.draw()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["64KiB", "1MiB", "8MiB"]
        assert ax.get_xlabel() == "block size"
    finally:
        plt.close(fig)
