"""A circuit breaker per server, and the background thread that closes them.

`CircuitBreaker` is a small state machine on an injectable clock. Closed: calls go through; each
failure adds to a count of consecutive failures, each success resets it. Refusals of the data path
(an ACL refusing GET or SET while it allows EXISTS) are also counted apart, and only a success of
the data path resets that count (`success(data=True)`): probes that keep succeeding do not hide
them. At `failures` consecutive failures (or data-path refusals) it opens: `guard()` raises
`RemoteUnavailable` at once (no socket I/O) until a reconnect check (`try_close`: the store's check)
succeeds; the first check is due `open_s` after opening, the next `open_s` after each failed check.
Nothing but the check closes it: there is no half-open state in which callers' requests serve as
probes, so no caller ever waits on a server that just failed.

`Reconnector` is the thread that runs the checks: it sleeps until the next check is due (or until
`wake()`), calls `poll()`, and stops on `stop()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.tiers.remote.errors import RemoteUnavailable, without_echo

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Opens after `failures` consecutive failures, stays open until a check succeeds (module doc)."""

    def __init__(self, name: str, failures: int, open_s: float, *, clock: Callable[[], float] = time.monotonic,
                 on_open: Callable[[], None] | None = None):
        if failures < 1 or open_s <= 0:
            raise ValueError(f"breaker: failures must be >= 1 and open_s > 0, got {failures}, {open_s}")
        self.name = name
        self.failures = failures
        self.open_s = open_s
        self._clock = clock
        self._on_open = on_open
        self._lock = threading.Lock()
        self._consecutive = 0
        self._refused = 0  # consecutive data-path refusals (reset by data-path successes only)
        self._open = False
        self._check_at = 0.0
        self._last_error = ""
        self.opens = 0
        self.closes = 0
        self.fast_fails = 0  # calls refused while open

    @property
    def available(self) -> bool:
        return not self._open

    @property
    def last_error(self) -> str:
        return self._last_error

    def guard(self) -> None:
        """Raise `RemoteUnavailable` when open; return at once otherwise."""
        if self._open:
            with self._lock:
                self.fast_fails += 1
            raise RemoteUnavailable(f"{self.name}: circuit breaker open after {self.failures} consecutive "
                                    f"failures (last: {self._last_error}); reconnecting in the background",
                                    "BreakerOpen")

    def success(self, data: bool = True) -> None:
        """A call that worked; `data`: a GET or SET (also resets the count of data-path refusals)."""
        if self._consecutive or (data and self._refused):
            with self._lock:
                self._consecutive = 0
                if data:
                    self._refused = 0

    def failure(self, error: str, refused: bool = False) -> bool:
        """Count one failure (`refused`: a refusal of the data path); True when it opened the breaker.
        `error` is kept (`last_error`) and logged without the arguments a server quotes (`without_echo`)."""
        error = without_echo(error)
        with self._lock:
            self._last_error = error
            self._consecutive += 1
            self._refused += refused
            if self._open or max(self._consecutive, self._refused) < self.failures:
                return False
            self._open = True
            self._check_at = self._clock() + self.open_s
            self.opens += 1
        log.info("%s: %d consecutive failures (last: %s); off for %.1f s, then a background check",
                    self.name, self.failures, error, self.open_s)
        if self._on_open is not None:
            self._on_open()
        return True

    def seconds_to_check(self) -> float | None:
        """None when closed, else seconds until the next reconnect check is due (<= 0: due now)."""
        if not self._open:
            return None
        return self._check_at - self._clock()

    def try_close(self, check: Callable[[], object]) -> bool:
        """Run `check` (it raises on failure); close the breaker when it succeeds, else schedule the
        next check `open_s` from now. True when closed afterwards."""
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any failure of the check keeps it open
            with self._lock:
                self._last_error = without_echo(str(exc)) or type(exc).__name__
                self._check_at = self._clock() + self.open_s
            return False
        with self._lock:
            was_open, self._open, self._consecutive, self._refused = self._open, False, 0, 0
            if was_open:
                self.closes += 1
        if was_open:
            log.info("%s: reachable again; circuit breaker closed", self.name)
        return True


class Reconnector:
    """A daemon thread that calls `poll()` whenever it is due. `poll` returns the seconds until it
    should run again, or None to sleep until `wake()`."""

    def __init__(self, name: str, poll: Callable[[], float | None]):
        self._poll = poll
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, wait: bool = True) -> None:
        """Stop the thread; `wait`: join it (up to 5 s) so that no `poll` runs afterwards."""
        self._stopped = True
        self._wake.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        delay: float | None = None
        while not self._stopped:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopped:
                return
            try:
                delay = self._poll()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failed check
                log.exception("remote reconnect check failed")
                delay = 1.0
            if delay is not None:
                delay = max(delay, 0.01)
