"""Every result file says when, on which code and on which machine it was measured."""

from __future__ import annotations

import calendar
import os
import subprocess
import time
from pathlib import Path

from kvtier.bench import provenance

ROOT = Path(__file__).resolve().parents[2]


def test_the_commit_is_the_checkouts_own_and_says_when_tracked_files_differ():
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode != 0:  # a copy of the tree without .git (the device machine's)
        assert provenance.commit() is None
        return
    head = git.stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert provenance.commit() == (f"{head}+dirty" if dirty else head)


def test_without_git_the_commit_is_unknown_not_an_error(monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert provenance.commit() is None


def test_the_record_names_the_time_the_machine_and_the_versions():
    record = provenance.provenance()
    created = calendar.timegm(time.strptime(record["created"], "%Y-%m-%dT%H:%M:%SZ"))
    assert abs(created - time.time()) < 60
    assert record["machine"]["cpus"] == os.cpu_count() and record["machine"]["python"]
    assert record["versions"]["kvtier"] and "torch" in record["versions"]
