"""A few iterations of the crash-consistency harness (kvtier.bench.crash) in CI.

The long run (>= 50 iterations) is documented in docs/reliability.md. Each iteration SIGKILLs a
child that stores and cascades through a memory (or shared-memory cpu) tier into a file tier,
restarts on the same root_dir and reads back every recovered block through the manager.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.bench import crash


@pytest.mark.parametrize("upper", ["memory", "cpu"])
def test_crash_iterations_serve_nothing_wrong(tmp_path, upper):
    report = crash.run(3, tmp_path / "root", upper=upper, seed=7, max_kill_delay=0.3, log=lambda *_: None)
    t = report["totals"]
    assert t["served_wrong"] == 0
    assert t["lost_durable"] == 0
    assert t["pins_left"] == 0
    assert t["child_complaints"] == 0
    assert t["child_died"] == 0, [r["child_died"] for r in report["rows"] if r["child_died"]]
    assert t["blocks_written"] > 0, "the child never reached the file tier: the harness tests nothing"
    assert t["served_ok"] > 0
    # every recovered block was either served byte-exactly or dropped by verification
    assert t["recovered"] == t["served_ok"] + t["dropped_by_verification"]
    if upper == "cpu":
        # A SIGKILLed owner cannot unlink its /dev/shm region (see docs/reliability.md); the harness
        # counts and removes them (and their claims), so none of this test's children is left behind.
        assert t["leaked_shm"] <= report["iterations"] and t["leaked_claims"] <= report["iterations"]


def test_leak_count_covers_temporaries_and_claims_of_the_killed_pid_only():
    pid = 4_000_000_000 + os.getpid()  # no live process has it: the files are this test's own
    mine = [f"kvtier-{pid}-ab12-cpu", f"kvtier-{pid}-ab12-cpu.kvtier-claim", f"kvtier-creating-{pid}-cd34"]
    other = f"kvtier-creating-{pid}1-cd34"
    for name in mine + [other]:
        open(os.path.join("/dev/shm", name), "xb").close()
    try:
        assert crash.remove_leaked_shm(pid) == (2, 1)  # two regions (one half-built), one claim
        assert not any(os.path.exists(os.path.join("/dev/shm", name)) for name in mine)
        assert os.path.exists(os.path.join("/dev/shm", other))
    finally:
        for name in mine + [other]:
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))


def test_crash_cli_writes_json_and_table(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.crash", "--iterations", "2", "--root",
                           str(tmp_path / "root"), "--max-kill-delay", "0.2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "served_ok" in proc.stdout and "totals:" in proc.stdout
    report = json.loads(out.read_text())
    assert report["schema"] == "kvtier.crash/1" and report["iterations"] == 2
    assert {"created", "commit", "machine", "versions"} <= set(report)
    assert report["totals"]["served_wrong"] == 0
