"""One screen of `scripts/gpu_check.sh`: each target of the GPU copy path, its figure, pass or fail.

    python scripts/gpu_check_summary.py OUT_DIR

Reads what gpu_check.sh left in OUT_DIR: `steps.txt` (one `NAME STATUS SECONDS` line per step),
`gpu_copy.json` (scripts/bench_gpu_copy.py), `plan.json` (its --plan-only run), `worker.json`
(scripts/gpu_check_worker.py) and `paths.txt`. A target whose file is missing or whose row has
an error is FAIL, never a pass. Exit status 0 when every line passed, 1 otherwise.

Targets (issue 37; ratios to one contiguous pinned copy in the same run):
- engine <-> CPU with scattered slots, the chosen (`auto`) path: >= 90 % each direction at
  64 KiB, 256 KiB and 2 MiB;
- both directions at once: >= 1.5x the faster one-direction contiguous copy;
- host work to plan a job of 256 blocks (one tensor): <= 50 us (compiled planner).
"""

from __future__ import annotations

import json
import os
import sys

RATIO_TARGET = 0.90
BOTH_TARGET = 1.5
PLAN_TARGET_US = 50.0
PAGES = (64 << 10, 256 << 10, 2 << 20)


def load(out: str, name: str) -> dict | None:
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def line(what: str, target: str, figure: str, ok: bool) -> tuple[str, bool]:
    return f"{what:<44} {target:<10} {figure:<22} {'PASS' if ok else 'FAIL'}", ok


def copy_lines(doc: dict | None) -> list[tuple[str, bool]]:
    """Scattered store/load ratios and both-at-once per page size, from the `auto` rows."""
    rows = {} if doc is None else {r["page"]: r for r in doc["rows"]
                                   if r.get("mode") == "auto" and r.get("slots") == "scattered"}
    out = []
    for page in PAGES:
        row = rows.get(page)
        name = f"{page >> 10} KiB" if page < (1 << 20) else f"{page >> 20} MiB"
        for key, what in (("d2h_ratio", "store"), ("h2d_ratio", "load")):
            if row is None or key not in row:
                out.append(line(f"scattered {what}, {name} pages", ">= 90 %", _missing(row), False))
                continue
            out.append(line(f"scattered {what}, {name} pages ({row.get('path', '?')})", ">= 90 %",
                            f"{row[key]:.0%} ({row[key.replace('ratio', 'gbps')]:.1f} GB/s)", row[key] >= RATIO_TARGET))
        if row is None or "both_ratio" not in row:
            out.append(line(f"both directions at once, {name} pages", ">= 1.5x", _missing(row), False))
        else:
            figure = f"{row['both_ratio']:.2f}x ({row['both_gbps']:.1f} GB/s)"
            out.append(line(f"both directions at once, {name} pages", ">= 1.5x", figure,
                            row["both_ratio"] >= BOTH_TARGET))
    return out


def _missing(row: dict | None) -> str:
    return "missing" if row is None else f"error: {str(row.get('error', 'not measured'))[:14]}"


def plan_lines(doc: dict | None) -> list[tuple[str, bool]]:
    rows = [] if doc is None else [r for r in doc["rows"] if r["layers"] == 1 and r["slots"] == "scattered"]
    if not rows:
        return [line("planning a 256-block job (this CPU)", "<= 50 us", "missing", False)]
    worst = max(rows, key=lambda r: r["compiled_us"])
    figure = f"{worst['compiled_us']:.1f} us (was {worst['reference_us']:.0f})"
    return [line(f"planning a {worst['blocks']}-block job (this CPU)", "<= 50 us", figure,
                 worst["compiled"] and worst["compiled_us"] <= PLAN_TARGET_US)]


def step_lines(out: str) -> list[tuple[str, bool]]:
    try:
        with open(os.path.join(out, "steps.txt")) as f:
            steps = [ln.split() for ln in f if ln.strip()]
    except OSError:
        return [line("steps", "", "steps.txt missing", False)]
    return [line(f"step {name}", "passes", f"{status} ({seconds} s)", status == "ok")
            for name, status, seconds in steps]


def worker_lines(doc: dict | None) -> list[tuple[str, bool]]:
    if doc is None:
        return [line("worker load/store path", "passes", "missing", False)]
    return [line(row["check"], "passes", "ok" if row["ok"] else row["seen"][:22], row["ok"]) for row in doc["rows"]]


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or ["gpu-check-out"])[0]
    copy = load(out, "gpu_copy.json")
    header = "kvtier GPU check" + (f": {copy['device']}, torch {copy['torch']}, CUDA {copy['cuda']}" if copy else "")
    print(header)
    if copy:
        print(f"one contiguous pinned copy: D2H {copy['contiguous_d2h_gbps']:.1f} GB/s, H2D "
              f"{copy['contiguous_h2d_gbps']:.1f} GB/s, both at once {copy.get('contiguous_both_gbps', 0):.1f} GB/s")
        for key, choice in copy.get("copy_choice", {}).items():
            figures = ", ".join(f"{name} {t['d2h_gbps']:.0f}/{t['h2d_gbps']:.0f}"
                                for name, t in choice["timings"].items())
            print(f"chosen on {key}: {choice['chosen']} (GB/s D2H/H2D: {figures})")
    worker = load(out, "worker.json")
    if worker is not None and worker.get("no_vllm"):
        print("note: vLLM does not import here; the worker checks ran through kvtier's standalone API")
    lines = step_lines(out) + copy_lines(copy) + plan_lines(load(out, "plan.json")) + worker_lines(worker)
    print(f"{'target':<44} {'wanted':<10} {'figure':<22} result")
    for text, _ in lines:
        print(text)
    failed = sum(1 for _, ok in lines if not ok)
    print(f"{len(lines) - failed} of {len(lines)} passed" + (f"; {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
