"""Crash-consistency harness: SIGKILL a process that stores and cascades, restart, check what is served.

    python -m kvtier.bench.crash --iterations 50 --root DIR [--upper memory|cpu] [--json FILE]

Each iteration a child builds a hierarchy with `kvtier.build_hierarchy` (a `memory` or shared-memory
`cpu` tier cascading `on_evict` into a `file` tier on `--root`) and stores blocks whose bytes derive
from their keys, as fast as it can. The parent SIGKILLs it at a random moment, restarts the
hierarchy on the same root_dir and reads back every block the file tier recovered through the
normal path (lookup -> RETRY -> promotion -> HIT -> prepare_load). The child prints `W <ids>` after
`FileBackend.write_blocks` returned (those must survive) and `F <id>` before a slot is freed.

Per iteration: `recovered`, `served_ok`, `dropped_by_verification`, `served_wrong` (must be 0),
`lost_durable` (must be 0), `resurrected`, `child_died`, `leaked_shm` and `leaked_claims` (with
`--upper cpu`; the harness removes what the killed child left). What each means:
docs/reliability.md, "Crash consistency". Prints a table and writes JSON (`--json`, default
`ROOT/crash-report.json`). Exit status 1 when a block was served wrong or a durable block was lost.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvtier.bench.provenance import provenance
from kvtier.bench.quiet import logger_at

BLOCK_BYTES = 16 * 1024
UPPER_BLOCKS = 16
FILE_BLOCKS = 64
FINGERPRINT = "kvtier-crash-harness/v1"


def key_for(block_id: int) -> bytes:
    from kvtier.core.keys import make_offload_key

    return make_offload_key(block_id.to_bytes(8, "big") * 2, 0)


def id_of(key: bytes) -> int:
    return int.from_bytes(bytes(key)[:8], "big")


def payload_for(block_id: int, block_bytes: int = BLOCK_BYTES) -> bytes:
    return hashlib.shake_128(block_id.to_bytes(8, "big")).digest(block_bytes)


def config_text(root: str | os.PathLike[str], upper: str, upper_blocks: int = UPPER_BLOCKS,
                file_blocks: int = FILE_BLOCKS, block_bytes: int = BLOCK_BYTES, *, upper_name: str = "upper",
                reserve: float = 0.25, fingerprint: str = FINGERPRINT) -> str:
    """A `upper` (memory or cpu) tier cascading into a posix file tier in `root` (any path: it
    is written as a JSON string, which YAML reads as is)."""
    pin = "\n    pin: false" if upper == "cpu" else ""
    return f"""
block_tokens: 16
block_bytes: {block_bytes}B
tiers:
  - name: {upper_name}
    backend: {upper}
    capacity: {upper_blocks} blocks
    policy: lru
    cascade: on_evict
    reserve: {reserve}{pin}
  - name: disk
    backend: file
    root_dir: {json.dumps(os.fspath(root))}
    capacity: {file_blocks} blocks
    policy: lru
    io: posix
    fingerprint: {fingerprint}
    num_threads: 2
"""


def build(root: str, upper: str):
    from kvtier import build_hierarchy, load_config_text

    return build_hierarchy(load_config_text(config_text(root, upper)))


# ------------------------------------------------------------------------------------------ child
def _report_disk_ops(disk, say) -> dict[int, bytes]:
    """Wrap the file backend's `write_blocks`, `free` and `allocate_blocks` so the child reports
    `W <ids>` after a write returned and `F <id>` before a slot is freed; returns the slot -> key
    map the wrappers keep (filled here with the blocks the tier recovered)."""
    write_blocks, free, allocate = disk.write_blocks, disk.free, disk.allocate_blocks
    slot_key: dict[int, bytes] = {}

    def reported_write(slots, keys, buffers):
        n = write_blocks(slots, keys, buffers)
        say("W " + ",".join(str(id_of(k)) for k in keys))
        return n

    def reported_free(block):
        key = slot_key.pop(block.block_id, None)
        if key is None:
            key = disk.committed().get(block.block_id)
        if key is not None:
            say(f"F {id_of(key)}")
        free(block)

    def tracked_allocate(keys):
        blocks = allocate(keys)
        for k, b in zip(keys, blocks):
            slot_key[b.block_id] = bytes(k)
        return blocks

    disk.write_blocks, disk.free, disk.allocate_blocks = reported_write, reported_free, tracked_allocate
    return slot_key


def _read_back(mgr, up, bid: int, say) -> None:
    """Re-read block `bid` through the manager (a promotion when it is only in the file tier)."""
    from kvtier import LookupResult

    key = key_for(bid)
    if mgr.lookup(key) is LookupResult.RETRY:
        mgr.on_schedule_end()
    if mgr.lookup(key) is LookupResult.HIT:
        spec = mgr.prepare_load([key])
        if spec.block_ids and bytes(up.view(spec.block_ids[0])) != payload_for(bid):
            say(f"X wrong bytes served for {bid} in the child")
        mgr.complete_load([key])


def _child(root: str, upper: str, seed: int) -> None:
    """Store storm through the manager until killed (never returns normally)."""
    out_lock = threading.Lock()

    def say(line: str) -> None:
        with out_lock:
            os.write(1, (line + "\n").encode())

    h = build(root, upper)
    mgr, disk, up = h.manager, h.backends["disk"], h.backends["upper"]
    slot_key = _report_disk_ops(disk, say)
    disk_policy = mgr.tiers[1].policy
    for key in list(disk_policy.keys()):
        slot_key[disk_policy.get(key).block_id] = bytes(key)
    rng = random.Random(seed)
    next_id = seed << 32
    known: list[int] = [id_of(k) for k in disk_policy.keys()]
    say("READY")
    while True:
        if known and rng.random() < 0.25:  # re-read an older block: promotions race with demotions
            _read_back(mgr, up, rng.choice(known), say)
            continue
        ids = list(range(next_id, next_id + rng.randint(1, 4)))
        next_id += len(ids)
        out = mgr.prepare_store([key_for(i) for i in ids])
        if out is None:
            mgr.on_schedule_end()
            continue
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids):
            up.view(slot)[:] = payload_for(id_of(key))
        mgr.complete_store(out.keys_to_store)
        mgr.on_schedule_end()
        known.extend(ids)
        if len(known) > 4 * FILE_BLOCKS:
            del known[:FILE_BLOCKS]


# ----------------------------------------------------------------------------------------- parent
def _run_child(root: Path, upper: str, seed: int, kill_after: float) -> tuple[list[str], int, str | None]:
    """Run one child, SIGKILL it `kill_after` s after READY; returns (its stdout lines, its pid, and
    None if the kill ended it, else how it ended by itself with the tail of its stderr)."""
    cmd = [sys.executable, "-m", "kvtier.bench.crash", "--child", "--root", str(root), "--upper", upper,
           "--seed", str(seed)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = child.stdout, child.stderr
    assert stdout is not None and stderr is not None  # both are pipes
    died = None
    try:
        first = stdout.readline().decode().strip()
        if first != "READY":
            child.kill()
            err = stderr.read().decode(errors="replace")
            raise RuntimeError(f"crash child did not start (rc {child.wait()}): {first} {err[-2000:]}")
        # Not synchronisation: this picks a random moment of the storm for the kill.
        time.sleep(kill_after)
        child.send_signal(signal.SIGKILL)
        # The kill can land while the child writes a report: the text after the last newline is
        # a torn line, never a whole report, so it is dropped.
        lines = stdout.read().decode(errors="replace").split("\n")[:-1]
        err = stderr.read().decode(errors="replace")
        if child.wait() != -signal.SIGKILL:
            died = f"exited by itself with status {child.returncode}: {err.strip()[-1500:]}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stdout.close()
        stderr.close()
    return lines, child.pid, died


def _durable_set(lines: list[str], durable: set[int]) -> tuple[set[int], int, int, list[str]]:
    """Apply the child's reports to `durable`; returns (freed ids, W records, F records, complaints)."""
    freed: set[int] = set()
    writes = frees = 0
    complaints = []
    for line in lines:
        if line.startswith("W "):
            ids = {int(x) for x in line[2:].split(",") if x}
            durable |= ids
            freed -= ids
            writes += len(ids)
        elif line.startswith("F "):
            bid = int(line[2:])
            durable.discard(bid)
            freed.add(bid)
            frees += 1
        elif line.startswith("X "):
            complaints.append(line)
    return freed, writes, frees, complaints


def _serve(mgr, up, disk_tier, key: bytes, answer, counts: dict[str, Any]) -> bool:
    """Finish reading back one recovered block whose first lookup answered `answer` (the
    promotions have finished): count it into `counts`; True when it was served byte-exactly."""
    from kvtier import LookupResult

    bid = id_of(key)
    result = mgr.lookup(key) if answer is LookupResult.RETRY else answer
    if result is LookupResult.HIT:
        spec = mgr.prepare_load([key])
        data = bytes(up.view(spec.block_ids[0]))
        mgr.complete_load([key])
        ok = data == payload_for(bid)
        counts["served_ok" if ok else "served_wrong"] += 1
        return ok
    if result is LookupResult.MISS:
        counts["dropped_by_verification"] += 1
        if disk_tier.policy.get(key) is not None:
            raise AssertionError(f"block {bid} answered MISS but is still in the file tier")
        return False
    raise AssertionError(f"block {bid}: lookup answered {result} after the promotion finished")


def verify_root(root: Path, upper: str, durable: set[int], freed: set[int],
                promote_batch: int = 1) -> tuple[dict[str, Any], set[int]]:
    """Restart the hierarchy on `root` and read back every recovered block through the manager.

    Blocks are promoted `promote_batch` at a time (one FILE -> CPU job per batch). With more than
    one, a block failing verification fails its whole job, and the manager then drops every block
    of that job from the file tier (good ones included): see docs/reliability.md."""
    h = build(str(root), upper)
    try:
        mgr, up = h.manager, h.backends["upper"]
        disk_tier = mgr.tiers[1]
        recovered = [bytes(k) for k in disk_tier.policy.keys()]
        counts: dict[str, Any] = {"recovered": len(recovered), "served_ok": 0, "dropped_by_verification": 0,
                                  "served_wrong": 0, "resurrected": 0}
        served: set[int] = set()
        batch_size = max(1, min(promote_batch, UPPER_BLOCKS // 2))
        for start in range(0, len(recovered), batch_size):
            batch = recovered[start:start + batch_size]
            first = [mgr.lookup(k) for k in batch]
            mgr.on_schedule_end()
            mgr.wait_idle()
            for key, answer in zip(batch, first):
                if _serve(mgr, up, disk_tier, key, answer, counts):
                    served.add(id_of(key))
                    counts["resurrected"] += id_of(key) in freed
        lost = durable - served
        counts["lost_durable"] = len(lost)
        counts["lost_ids"] = sorted(lost)[:20]
        leftover_pins = [k for t in mgr.tiers for k in t.policy.keys() if t.policy.get(k).ref_cnt != 0]
        counts["pins_left"] = len(leftover_pins)
        return counts, served
    finally:
        h.close()


def remove_leaked_shm(pid: int) -> tuple[int, int]:
    """Remove what the killed child `pid` left in /dev/shm: (regions, claims) removed. Its CPU
    tier's generated name is `kvtier-<pid>-...`; a kill while building it leaves `kvtier-creating-<pid>-...`."""
    from kvtier.tiers.cpu.backend import CLAIM_SUFFIX

    paths = glob.glob(f"/dev/shm/kvtier-{pid}-*") + glob.glob(f"/dev/shm/kvtier-creating-{pid}-*")
    for path in paths:
        os.unlink(path)
    claims = sum(1 for path in paths if path.endswith(CLAIM_SUFFIX))
    return len(paths) - claims, claims


@logger_at("kvtier.transfer.router", logging.ERROR)  # failed verifications are counted, not logged
def run(iterations: int, root: Path, upper: str = "memory", seed: int = 0, max_kill_delay: float = 0.6,
        log=print, promote_batch: int = 1) -> dict:
    root = Path(root)
    rng = random.Random(seed)
    durable: set[int] = set()
    rows = []
    started = time.perf_counter()
    for it in range(iterations):
        kill_after = rng.uniform(0.02, max_kill_delay)
        lines, pid, died = _run_child(root, upper, seed * 1000 + it + 1, kill_after)
        freed, writes, frees, complaints = _durable_set(lines, durable)
        leaked, claims = remove_leaked_shm(pid)
        counts, served = verify_root(root, upper, durable, freed, promote_batch)
        row = {"iteration": it, "kill_after_s": round(kill_after, 4), "blocks_written": writes, "frees": frees,
               **counts, "child_complaints": complaints, "leaked_shm": leaked,
               "leaked_claims": claims, "child_died": died}
        rows.append(row)
        log(f"{it:>4} {kill_after:>7.3f} {writes:>7} {frees:>6} {counts['recovered']:>9} {counts['served_ok']:>9} "
            f"{counts['dropped_by_verification']:>7} {counts['served_wrong']:>6} {counts['lost_durable']:>5} "
            f"{counts['resurrected']:>6} {leaked:>5}" + (f"  CHILD DIED: {died.splitlines()[-1]}" if died else ""))
        durable = served  # what the next child starts from (it recovers the same blocks)
    totals = {k: sum(r[k] for r in rows) for k in ("blocks_written", "frees", "recovered", "served_ok",
                                                    "dropped_by_verification", "served_wrong", "lost_durable",
                                                    "resurrected", "pins_left", "leaked_shm",
                                                    "leaked_claims")}
    totals["child_complaints"] = sum(len(r["child_complaints"]) for r in rows)
    totals["child_died"] = sum(1 for r in rows if r["child_died"])
    return {"schema": "kvtier.crash/1", "iterations": iterations, "upper": upper, "seed": seed,
            "block_bytes": BLOCK_BYTES, "upper_blocks": UPPER_BLOCKS, "file_blocks": FILE_BLOCKS,
            "promote_batch": promote_batch, "root_dir": str(root), "seconds": round(time.perf_counter() - started, 2),
            "totals": totals, "rows": rows}


HEADER = (f"{'it':>4} {'kill_s':>7} {'written':>7} {'frees':>6} {'recovered':>9} {'served_ok':>9} "
          f"{'dropped':>7} {'wrong':>6} {'lost':>5} {'resurr':>6} {'shm':>5}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.crash", description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--root", required=True, help="file-tier root_dir (reused across iterations)")
    p.add_argument("--upper", choices=["memory", "cpu"], default="memory", help="tier in front of the file tier")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-kill-delay", type=float, default=0.6, help="kill within this many seconds of READY")
    p.add_argument("--promote-batch", type=int, default=1,
                   help="blocks per verification promotion job (>1 shows collateral drops of good blocks)")
    p.add_argument("--json", help="report path (default ROOT/crash-report.json)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.root, args.upper, args.seed)
        return 0
    print(HEADER)
    report = run(args.iterations, Path(args.root), args.upper, args.seed, args.max_kill_delay,
                 promote_batch=args.promote_batch)
    t = report["totals"]
    print(f"totals: {json.dumps(t)}  ({report['seconds']} s)")
    path = Path(args.json) if args.json else Path(args.root) / "crash-report.json"
    path.write_text(json.dumps({**provenance(), **report}, indent=1))
    print(f"JSON written to {path}")
    return 1 if t["served_wrong"] or t["lost_durable"] or t["child_complaints"] or t["pins_left"] \
        or t["child_died"] else 0


if __name__ == "__main__":
    sys.exit(main())
