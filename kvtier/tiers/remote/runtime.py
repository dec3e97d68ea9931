"""The valkey tier's run-time bookkeeping: the probe queue, write pauses, and the failure notice.

Each is thread-safe and does no socket I/O itself; `kvtier.tiers.remote.backend.ValkeyBackend` uses them.

- `ProbeQueue`: the probe batches waiting for the probe thread, at most `MAX_QUEUED` (a new batch
  pushes the oldest out), each with the deadline by which its answer is of use; a batch whose deadline
  passed before the thread took it is dropped unsent (the lookups waiting on it were answered MISS
  at that deadline). With one probe thread, at most one batch per server is in flight.
- `FoundBy`: the deadline of the probe that found each block, by which its promotion must read it.
- `WritePause`: after a failed write or a slow one, publishing pauses for `open_s`; the keys not
  written are reported by `take_unsent`.
- `FailureNotice`: the first failure of the tier logs ONE WARNING naming the server and the cause
  (`AuthenticationError`, `NoPermissionError`, `TimeoutError`, `SlowAnswer`, ...); later failures
  are counted, and a WARNING is logged again only for a cause not logged before (at most one per
  cause in the tier's life, so a flapping server cannot flood the log); a recovery is logged at INFO.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tiers.remote.errors import without_echo

log = logging.getLogger("kvtier.tiers.remote")

MAX_QUEUED = 2  # probe batches waiting for the probe thread (besides the one in flight)
MAX_FOUND = 4096  # deadlines of blocks found by probes kept (expired ones go first, then the oldest)


class ProbeQueue:
    """Probe batches `(deadline, keys)` for the probe thread; see the module docstring."""

    def __init__(self) -> None:
        self._batches: deque[tuple[float, list[bytes]]] = deque()
        self._ready = threading.Condition()
        self._stopped = False
        self.shed = 0  # batches dropped unsent: pushed out by newer ones, or past their deadline

    def __len__(self) -> int:
        return len(self._batches)

    def put(self, keys: list[bytes], deadline: float) -> None:
        with self._ready:
            self._batches.append((deadline, keys))
            while len(self._batches) > MAX_QUEUED:
                self._batches.popleft()
                self.shed += 1
            self._ready.notify()

    def get(self) -> tuple[float, list[bytes]] | None:
        """The next batch whose deadline has not passed (waiting for one); None once stopped."""
        with self._ready:
            while True:
                if self._stopped:
                    return None
                now = time.monotonic()
                while self._batches and self._batches[0][0] <= now:
                    self._batches.popleft()
                    self.shed += 1
                if self._batches:
                    return self._batches.popleft()
                self._ready.wait()

    def stop(self) -> None:
        with self._ready:
            self._stopped = True
            self._batches.clear()
            self._ready.notify_all()


class FoundBy:
    """Blocks found by a probe -> that probe's deadline: their promotion must read them by it."""

    def __init__(self) -> None:
        self._by: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def remember(self, batch: list[bytes], found: list[bool], deadline: float) -> None:
        with self._lock:
            by = self._by
            by.update((k, deadline) for k, f in zip(batch, found) if f)
            if len(by) > MAX_FOUND:
                now = time.monotonic()
                for key in [k for k, d in by.items() if d <= now]:
                    del by[key]
                while len(by) > MAX_FOUND:
                    del by[next(iter(by))]

    def deadline(self, keys: Sequence[bytes], deadline: float | None, timeout_s: float) -> float:
        """The earliest of `deadline` (default `timeout_s` from now) and the deadlines of the probes
        that found `keys` (taken: each is used once). A probe's deadline that had passed when this
        read was started (`deadline` - `timeout_s`) is not used: that promotion did not come from its
        lookup (e.g. it was refused for room, and a later lookup used the handle)."""
        out = time.monotonic() + timeout_s if deadline is None else deadline
        started = out - timeout_s
        with self._lock:
            for key in keys:
                found_by = self._by.pop(bytes(key), None)
                if found_by is not None and found_by > started:
                    out = min(out, found_by)
        return out


def cause_of(exc: BaseException) -> str:
    """The name of what went wrong: a `RemoteUnavailable`'s `cause`, else the exception's type."""
    return getattr(exc, "cause", "") or type(exc).__name__


class FailureNotice:
    """One WARNING per cause with the server's name (module docstring); `failures` counts them all."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        self.failures = 0
        self._logged: set[str] = set()  # causes logged (never forgotten: one WARNING each)
        self._failing = False  # failures since the last success
        self._lock = threading.Lock()

    def failed(self, exc: BaseException, what: str = "") -> None:
        """Count one failure; the first of its cause is logged. `what`: the consequence, added to
        the message (e.g. publishing paused)."""
        cause = cause_of(exc)
        with self._lock:
            self.failures += 1
            self._failing = True
            if cause == "BreakerOpen" or cause in self._logged:
                return
            self._logged.add(cause)
            first = len(self._logged) == 1
        log.warning("valkey tier %s: %s %s (%s): %s%s; %s", self.name, self.url,
                    "failed" if first else "failed with another cause", cause, without_echo(str(exc)),
                    what and f"; {what}",
                    "lookups miss and blocks are recomputed meanwhile; later failures are counted, not logged "
                    "(stats: shared.probe_failures, read_failures, write_failures)")

    def recovered(self) -> None:
        """A call that worked: logged (INFO) when failures came before it."""
        if not self._failing:
            return
        with self._lock:
            failing, self._failing = self._failing, False
            failures = self.failures
        if failing:
            log.info("valkey tier %s: %s answers again (%d failures so far)", self.name, self.url, failures)


class WritePause:
    """When writes are refused (after a slow or a failed write, for `open_s`), and the keys of
    publish jobs that were not written. Thread-safe; a failure is reported to `notice`."""

    def __init__(self, name: str, open_s: float, notice: FailureNotice):
        self.name, self.open_s, self.notice = name, open_s, notice
        self.slow_until = 0.0
        self.failed_until = 0.0
        self._unsent: set[bytes] = set()
        self._lock = threading.Lock()

    def accepts(self, now: float) -> bool:
        return now >= self.slow_until and now >= self.failed_until

    def write(self, store: Callable[[], Any], keys: Sequence[bytes], buffers: Sequence, slow: float,
              counters: dict[str, int], deadline: float | None = None) -> int:
        """`ValkeyBackend.put_blocks`' writes: bytes sent. A write slower than `slow` s or a failed one
        pauses writes and leaves the rest of the keys unsent (a failed one: its own key too), as does
        a pause at the start or `deadline` passing (counted in `late_writes`): a job never keeps
        writing to a server that is slow or failing, nor past its deadline."""
        sent = 0
        for i, (key, buf) in enumerate(zip(keys, buffers)):
            start = time.monotonic()
            late = deadline is not None and start >= deadline
            if late or start < self.failed_until or start < self.slow_until:
                counters["late_writes"] += len(keys) - i if late else 0
                self.not_sent(keys[i:])
                break
            try:
                sent += store().write_block(bytes(key), memoryview(buf).cast("B"), deadline)
            except Exception as exc:  # noqa: BLE001 - any failed write pauses writes; its keys stay unsent
                counters["write_failures"] += 1
                self.failed(exc)
                self.not_sent(keys[i:])
                break
            end = time.monotonic()
            if end - start > slow:
                self.slow_until = end + self.open_s
                counters["slow_writes"] += 1
        return sent

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failed_until = time.monotonic() + self.open_s
        self.notice.failed(exc, f"a write failed; publishing paused for {self.open_s:g} s")

    def not_sent(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._unsent.update(map(bytes, keys))

    def take_unsent(self, keys: Sequence[bytes]) -> list[bytes]:
        with self._lock:
            if not self._unsent:
                return []
            out = [bytes(k) for k in keys if bytes(k) in self._unsent]
            self._unsent.difference_update(out)
            return out
