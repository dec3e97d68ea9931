"""The walk of one `prepare_store`, from vLLM's adapter to the tier that takes the block: the
kvtier modules whose code runs, and the cycles among them (a module entered again while its own
call is still below on the stack, e.g. cascade -> tier -> cascade).

Measured at run time (`sys.setprofile`) in a two-tier hierarchy (cpu + file, dry run: the control
plane's own path, no bytes), for three stores of two blocks into the cpu tier: one with room there,
one that evicts blocks already copied down (clean), and one that must first copy its victims down
(dirty: a demotion job through the router; the figure of issue 41). Prints each walk and writes JSON:

    python -m benchmarks.walks [--json walks.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier import build_hierarchy, load_config_text
from kvtier.bench.provenance import provenance

CONFIG = """
block_bytes: 64B
tiers:
  - {name: cpu, backend: cpu, capacity: 8 blocks, cascade: on_evict}
  - {name: disk, backend: file, capacity: 64 blocks, root_dir: /tmp/kvtier-walks}
"""


def _module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name.startswith("kvtier.") else None


def trace(call: Any) -> tuple[list[str], list[list[str]]]:
    """Run `call()`; the kvtier modules entered, in first-entry order, and the cycles seen
    (each as the stack of modules from the first entry of the repeated one to its re-entry)."""
    order: dict[str, None] = {}
    stack: list[str] = []  # kvtier modules of the frames on the stack, deduplicated when adjacent
    depth: list[bool] = []  # per Python frame: whether it pushed onto `stack`
    cycles: list[list[str]] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            module = _module(frame)
            pushed = module is not None and (not stack or stack[-1] != module)
            if pushed and module is not None:  # (the second test for the type checker)
                if module in stack:
                    cycle = stack[stack.index(module):] + [module]
                    if cycle not in cycles:
                        cycles.append(cycle)
                stack.append(module)
                order.setdefault(module)
            depth.append(pushed)
        elif event == "return" and depth:
            if depth.pop():
                stack.pop()

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(order), cycles


SCENARIOS = {  # name -> (blocks stored before, whether they are copied down first)
    "room": (4, False),
    "evicts clean": (8, True),
    "evicts dirty": (8, False),
}


def walk(stored_before: int, copied_down: bool) -> tuple[list[str], list[list[str]]]:
    """The walk of one `prepare_store` of two new blocks through vLLM's adapter, after storing
    `stored_before` blocks (two per request), copied down to the file tier first or not."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvtier.integrations.vllm.manager import KVTierOffloadingManager

    hierarchy = build_hierarchy(load_config_text(CONFIG), block_bytes=64, dry_run=True)
    manager = KVTierOffloadingManager(hierarchy)
    ctx = ReqContext("walk")
    keys = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(12)]
    try:
        for i in range(0, stored_before, 2):
            out = manager.prepare_store(keys[i:i + 2], ctx)
            assert out is not None, "a fresh tier has room"
            manager.complete_store(out.keys_to_store, ctx)
        if copied_down:
            hierarchy.manager.flush()
        hierarchy.manager.wait_idle(10)
        return trace(lambda: manager.prepare_store(keys[8:10], ctx))
    finally:
        hierarchy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    walks = {}
    for name, (stored_before, copied_down) in SCENARIOS.items():
        modules, cycles = walk(stored_before, copied_down)
        walks[name] = {"modules": modules, "cycles": cycles}
        print(f"prepare_store ({name}): {len(modules)} kvtier modules, {len(cycles)} cycles")
        for module in modules:
            print(f"  {module}")
        for cycle in cycles:
            print("  cycle: " + " -> ".join(cycle))
    if args.json:
        with open(args.json, "w") as out_file:
            json.dump({**provenance(), "walk": "prepare_store", "walks": walks}, out_file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
