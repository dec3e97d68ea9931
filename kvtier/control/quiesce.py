"""Bringing a hierarchy's control plane to rest: waiting for its jobs, flushing, shutting down.

`Quiescer` holds no state of its own; it drives the manager's parts (`JobTable`, `Cascade`,
`Promotions`, `SharedTierProbes`) until the work they started has ended, and is what
`HierarchyManager.wait_idle`, `flush` and `shutdown` do (their docstrings are the contracts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.control.cascade import Cascade
from kvtier.control.context import ControlContext
from kvtier.control.promotion import Promotions
from kvtier.control.shared_probes import SharedTierProbes
from kvtier.control.tier import Tier
from kvtier.core.errors import WaitTimeout
from kvtier.core.keys import OffloadKey
from kvtier.transfer.router import TransferRouter

log = logging.getLogger("kvtier.control.manager")  # (its messages are the manager's)
FLUSH_RECHECK_S = 0.1  # how often a `flush` given a `check` calls it while waiting
CLOSE_SHARE_S = 1.0  # of a shutdown's timeout, what is kept for the backends to close (at most half)


def _jobs(n: int) -> str:
    return f"{n} transfer job" + ("" if n == 1 else "s")


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (a `time.monotonic()` value; never negative), None for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Quiescer:
    """Waits for the jobs a manager's controllers started, and runs its flush and shutdown."""

    def __init__(self, ctx: ControlContext, router: TransferRouter, cascade: Cascade, promotions: Promotions,
                 shared: SharedTierProbes | None):
        self._tiers = ctx.tiers
        self._router = router
        self._jobs = ctx.jobs
        self._cascade = cascade
        self._promotions = promotions
        self._shared = shared

    def wait_idle(self, timeout: float | None) -> None:
        """`HierarchyManager.wait_idle`: `WaitTimeout` naming the jobs still running after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._shared is not None:
            self._shared.wait_probes(deadline)  # what they find is queued for promotion, awaited below
        self._cascade.advance_writes()
        while self._jobs or self._promotions.queue:
            if self._promotions.queue:
                self._promotions.flush()
            if self._jobs and not self._jobs.wait(deadline):
                running = self._jobs.describe()
                raise WaitTimeout(f"wait_idle: {_jobs(len(running))} still running after {timeout:g} s "
                                  f"(a handler may be hung): {'; '.join(running)}", running)
            self._jobs.drain()
            self._cascade.advance_writes()

    def flush(self, timeout: float | None, check: Callable[[], None] | None = None) -> int:
        """`HierarchyManager.flush`: the blocks of cascading tiers still without a copy below."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cascading = [t for t in self._tiers if t.below is not None and t.cascade != "none"]
        try:
            self._wait_checking(deadline, check)
            for tier in cascading:
                tried: set[OffloadKey] = set()
                while self._cascade.flush_step(tier, max(1, 2 * tier.reserve), tried):
                    self._wait_checking(deadline, check)
        except WaitTimeout:
            pass
        return sum(len(self._cascade.dirty_keys(t)) for t in cascading)

    def _wait_checking(self, deadline: float | None, check: Callable[[], None] | None) -> None:
        """`wait_idle` until `deadline` (`WaitTimeout` then), calling `check` between slices."""
        while True:
            left = _left(deadline)
            if check is None or (left is not None and left <= FLUSH_RECHECK_S):
                return self.wait_idle(left)
            try:
                return self.wait_idle(FLUSH_RECHECK_S)
            except WaitTimeout:
                check()

    def shutdown(self, timeout: float | None, keep_open: set[str]) -> None:
        """`HierarchyManager.shutdown`: the router and backends closed, but those of copies still
        running after `timeout` s (abandoned, logged) and those of `keep_open` left open. Within
        `timeout` s in all: the last `CLOSE_SHARE_S` of it (at most half) is the backends' to close,
        and a backend whose close is still running then (a sync hung in the kernel) is abandoned
        and logged, its files left as a crash would leave them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = None if timeout is None else timeout - min(CLOSE_SHARE_S, timeout / 2)
        try:
            self.wait_idle(waited)
        except WaitTimeout as exc:
            busy = self._jobs.tiers()
            log.error("shutdown abandoned %s still running after %g s: %s. The transfer router "
                      "and the backends of tiers %s are left open; their blocks may be incomplete.",
                      _jobs(len(exc.jobs)), waited, "; ".join(exc.jobs), ", ".join(sorted(busy)))
            keep_open = keep_open | busy
        else:
            self._router.shutdown()
        close_backends([t for t in self._tiers if t.name not in keep_open], deadline)


def close_backends(tiers: list[Tier], deadline: float | None) -> None:
    """Close the backends of `tiers`, each in a thread of its own, waiting for them until `deadline`
    (None: no limit); those still closing then are abandoned (daemon threads) and logged by tier.
    The first error a close raised is raised once every other close ended or was abandoned."""
    errors: list[BaseException] = []

    def close(backend: Any) -> None:
        try:
            backend.close()
        except BaseException as exc:  # (raised in the caller's thread, below)
            errors.append(exc)

    closing = []
    for tier in tiers:
        thread = threading.Thread(target=close, args=(tier.backend,), name=f"kvtier-close-{tier.name}", daemon=True)
        thread.start()
        closing.append((tier, thread))
    hung = []
    for tier, thread in closing:
        thread.join(_left(deadline))
        if thread.is_alive():
            hung.append(tier.name)
    if hung:
        log.error("close abandoned the backends of tiers %s, still closing at the deadline (a write or sync hung in "
                  "the kernel?): what they had not written is lost as in a crash; the next start recovers the rest",
                  ", ".join(hung))
    if errors:
        raise errors[0]
