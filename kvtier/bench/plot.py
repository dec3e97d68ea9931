"""PNG plots of a `kvtier bench` document: bandwidth per hop against block size (with the
same-run baselines dashed) and hit rate per tier against first-tier capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.bench.trace_report import run_label
from kvtier.config import format_size
from kvtier.core.errors import KVTierError


def plot_bench(doc: dict[str, Any], path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - any import failure: tell the user how to get it
        raise KVTierError(f"--plot needs matplotlib ({exc}); install it with: pip install 'kvtier[plot]'") from None
    panels = [p for p in (("hops", _plot_hops), ("trace", _plot_trace)) if doc.get(p[0])]
    if not panels:
        raise KVTierError("nothing to plot: the run measured no hop and no trace")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    for ax, (key, draw) in zip(axes[0], panels):
        draw(ax, doc[key])
    machine = doc.get("machine", {})
    fig.suptitle(f"kvtier bench on {machine.get('cpus', '?')} CPUs, {doc.get('created', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hops(ax, rows: list[dict[str, Any]]) -> None:
    from kvtier.bench.hops_runner import hop_label

    hops = sorted({hop_label(r) for r in rows})
    for i, hop in enumerate(hops):
        mine = sorted((r for r in rows if hop_label(r) == hop), key=lambda r: r["block_bytes"])
        sizes = [r["block_bytes"] for r in mine]
        color = f"C{i}"
        ax.plot(sizes, [r["gbps"] for r in mine], "o-", color=color, label=f"{hop} (kvtier)")
        if any(r.get("baseline_gbps") for r in mine):
            ax.plot(sizes, [r.get("baseline_gbps") or float("nan") for r in mine], "--", color=color, alpha=0.6,
                    label=f"{hop} baseline: {mine[0].get('baseline', '')}")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["block_bytes"] for r in rows})
    ax.set_xticks(ticks, [format_size(t) for t in ticks])  # 64KiB, 1MiB: not 2^6 KiB
    ax.minorticks_off()
    ax.set_xlabel("block size")
    ax.set_ylabel("GB/s")
    ax.set_title("bandwidth per hop")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _plot_trace(ax, trace: dict[str, Any]) -> None:
    runs = [r for r in trace["runs"] if r["system"] == "kvtier"]
    for i, line in enumerate(sorted({run_label(r) for r in runs})):
        mine = sorted((r for r in runs if run_label(r) == line), key=lambda r: r["capacity_blocks"])
        caps = [r["capacity_blocks"] for r in mine]
        ax.plot(caps, [r["hit_rate"] for r in mine], "o-", color=f"C{i}", label=f"{line}: all tiers")
        tier_names = list(mine[0]["tiers"])
        for j, name in enumerate(tier_names):
            ax.plot(caps, [r["tiers"][name]["hit_rate"] for r in mine], [":", "-."][j % 2], color=f"C{i}",
                    alpha=0.7, label=f"{line}: {name}")
    vllm = [r for r in trace["runs"] if r["system"] == "vllm"]
    for k, r in enumerate(vllm):  # (at the size compared with: vLLM holds kvtier's total across tiers)
        ax.plot([r["capacity_blocks"]], [r["hit_rate"]], "x", color="black",
                label="vLLM (as many blocks in all)" if k == 0 else None)
    ceilings = sorted((o["capacity_blocks"], o["hit_rate"]) for o in trace.get("optimum", []))
    if ceilings:
        ax.plot([c for c, _ in ceilings], [h for _, h in ceilings], "s--", color="black",
                label="offline optimum (Belady)")
    ax.axhline(trace["optimum_hit_rate"], color="grey", ls="--", label="unlimited space")
    ax.set_xscale("log")
    ax.set_xlabel("first-tier capacity (blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_title(f"trace replay: {trace['trace']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
