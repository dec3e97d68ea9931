"""The processes that own kvtier's files and regions (whose pid a lock or claim file records)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's counts: signalling it is refused, EPERM).
    The answer can be stale as soon as it is given; callers pair it with a lock for decisions."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, it is another user's
        return True
    return True
