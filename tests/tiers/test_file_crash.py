"""Crash safety: SIGKILL a process in the middle of a store storm, restart, check what is served.

Every block the journal recovers either reads back byte-exactly or fails verification (and is then
dropped); only blocks whose write was in flight at the kill may be lost or fail. Every block whose
write had completed before the kill is recovered and served.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier import IntegrityError
from kvtier.tiers.file import FileBackend

sys.path.insert(0, str(Path(__file__).parent))
from crash_child import id_payload, key_id  # noqa: E402

CHILD = Path(__file__).with_name("crash_child.py")
NUM_BLOCKS, BLOCK_BYTES, KILLS = 48, 256 * 1024, 24


def storm_until_killed(root: Path, seed: int, writes_before_kill: int, delay: float) -> list[str]:
    """Run the child until it starts its `writes_before_kill`-th write, SIGKILL it `delay` seconds
    later (a random point inside that write or the next ones), return everything it printed."""
    child = subprocess.Popen([sys.executable, str(CHILD), str(root), str(seed), str(NUM_BLOCKS), str(BLOCK_BYTES)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, writes = [], 0
    try:
        while writes < writes_before_kill:
            line = child.stdout.readline()
            if not line:
                raise AssertionError(f"child exited early: {child.wait()} {child.stderr.read()}")
            lines.append(line.strip())
            writes += line.startswith("B")
        time.sleep(delay)  # not synchronisation: picks where in the I/O the kill lands
        child.send_signal(signal.SIGKILL)
        # A line without its newline was torn by the kill: a `B` cut short was printed before its
        # write started, a `C` cut short leaves that write in flight (old or new bytes allowed).
        lines.extend(line.strip() for line in child.stdout if line.endswith("\n"))
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    return lines


def apply(lines: list[str], expected: dict[int, int]) -> dict[int, set]:
    """Apply committed writes to `expected` (slot -> id); return slot -> ids allowed for in-flight slots."""
    pending = None
    for line in lines:
        if line.startswith("B"):
            _, slots, ids = line.split()
            pending = list(zip(map(int, slots.split(",")), map(int, ids.split(","))))
        elif line == "C":
            expected.update(pending)
            pending = None
    return {slot: {expected.get(slot), i} for slot, i in (pending or [])}


def test_sigkill_during_store_storm(tmp_path):
    root = tmp_path / "kv"
    rng = random.Random(1234)
    expected: dict[int, int] = {}
    totals = {"kills": 0, "recovered": 0, "served_exact": 0, "dropped_in_flight": 0, "in_flight_slots": 0,
              "completed_before_kill": 0}
    for kill in range(KILLS):
        lines = storm_until_killed(root, kill + 1, rng.randint(1, 6), rng.choice([0.0, rng.uniform(0, 0.004)]))
        in_flight = apply(lines, expected)
        totals["kills"] += 1
        totals["in_flight_slots"] += len(in_flight)
        totals["completed_before_kill"] += sum(1 for s in expected if s not in in_flight)
        backend = FileBackend("crash", NUM_BLOCKS, BLOCK_BYTES, 16, root_dir=str(root), io="posix",
                              fingerprint="crash-test")
        try:
            recovered = {block.block_id: key for key, block in backend.recover()}
            totals["recovered"] += len(recovered)
            served: dict[int, int] = {}
            for slot, key in recovered.items():
                out = bytearray(BLOCK_BYTES)
                try:
                    backend.read_blocks([slot], [key], [out])
                except IntegrityError:
                    assert slot in in_flight, f"slot {slot} failed verification but its write had completed"
                    totals["dropped_in_flight"] += 1
                    continue
                block_id = key_id(key)
                assert bytes(out) == id_payload(block_id, BLOCK_BYTES), f"slot {slot} served wrong bytes"
                assert block_id in in_flight.get(slot, {expected.get(slot)}), f"slot {slot} holds a stale block"
                served[slot] = block_id
                totals["served_exact"] += 1
            lost = {s for s in expected if s not in served and s not in in_flight}
            assert not lost, f"completed writes lost after kill {kill}: slots {sorted(lost)}"
            expected = served
        finally:
            backend.close()
    print(f"\ncrash test: {totals}")
    # The storm was really interrupted: some kills landed while a write was in flight (else the
    # torn-write half of the claim was never exercised) ...
    assert totals["in_flight_slots"] > 0, f"no kill landed during a write: {totals}"
    # ... and every block whose write had completed was served back (`lost` above, per kill).
    assert totals["served_exact"] >= totals["completed_before_kill"] > 0, totals
