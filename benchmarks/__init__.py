"""Measurement harnesses that are not `kvtier bench`: the request-cycle cost (`cycle`), index memory
per block (`memory`), the control plane under pinned blocks (`control_plane`), the manager soak
(`soak`) and the replacement-policy study (`policy_study`).

Not installed with kvtier (pyproject's packages.find lists only `kvtier*`): run them from a checkout's
root, e.g. `python -m benchmarks.cycle --repeats 3 --multi`. `kvtier bench` (kvtier/bench, kvtier/cli)
stays the measurement a user runs.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment for a harness's child process (`python -m benchmarks.X --child ...`): this
    checkout's root first on PYTHONPATH, so the child imports `benchmarks` from any working directory."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)}
