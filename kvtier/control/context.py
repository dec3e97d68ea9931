"""`ControlContext`: what the controllers of one hierarchy share, and nothing else.

The controllers (`LoadPins`, `StorePath`, `Cascade`, `Promotions`, `SharedTierProbes`) are peers:
each gets this context (the tiers in chain order, the table of running jobs, the event log, the
retention hints) and, where it needs another's help, that controller or one of its methods, from
`kvtier.control.manager.HierarchyManager`, which composes them. None constructs another.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.control.jobs import EventLog, JobTable
from kvtier.control.retention import Retention
from kvtier.control.tier import Tier


@dataclass(frozen=True)
class ControlContext:
    """The tiers (chain order; a shared tier last), the jobs running between them, the events,
    the sessions' retention hints."""

    tiers: list[Tier]
    jobs: JobTable
    events: EventLog
    retention: Retention

    @property
    def top(self) -> Tier:
        """The first tier: every engine store and every promotion lands here."""
        return self.tiers[0]
