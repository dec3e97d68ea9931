"""The valkey tier's probe thread: batches of keys asked of the server, and the answers it leaves.

`ValkeyBackend.request_probe` hands a batch to `Probes.request` (never blocks; the thread starts
with the first batch); the thread takes batches from a `runtime.ProbeQueue` (at most
`MAX_QUEUED` waiting, those past their deadline dropped unsent), asks the store which keys it
holds by the batch's deadline, and leaves `(keys, found)` for `results` (`found` None when the
probe failed). Keys found are remembered with that deadline (`FoundBy`): their read must finish
by it. The thread is the only place a probe touches a socket.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtier.tiers.remote.runtime import FailureNotice, FoundBy, ProbeQueue


class Probes:
    """The probe thread of the valkey tier `name`. `store` returns the tier's store (building it when
    needed); each batch is answered within `timeout_s` of its request. `counters` (the backend's) get
    `probes`, `probe_failures` and `probes_shed`; failures and recoveries go to `notice`."""

    def __init__(self, name: str, store: Callable[[], Any], timeout_s: float, notice: FailureNotice,
                 found_by: FoundBy, counters: dict[str, int]):
        self.name = name
        self._store = store
        self._timeout_s = timeout_s
        self._notice = notice
        self._found_by = found_by
        self._counters = counters
        self._queue = ProbeQueue()
        self.answers: deque[tuple[list[bytes], list[bool] | None]] = deque()  # read by `results`
        self._thread: threading.Thread | None = None
        self._stopped = False

    def __len__(self) -> int:
        """Batches waiting for the thread (not the one in flight)."""
        return len(self._queue)

    def request(self, keys: list[bytes]) -> None:
        """Queue one batch (answered failed at once once stopped); starts the thread the first time."""
        if self._stopped:
            self.answers.append((keys, None))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"kvtier-probe-{self.name}", daemon=True)
            self._thread.start()
        self._queue.put(keys, time.monotonic() + self._timeout_s)

    def results(self) -> list[tuple[list[bytes], list[bool] | None]]:
        """The batches answered since the last call."""
        out = []
        while self.answers:
            out.append(self.answers.popleft())
        return out

    @property
    def answered(self) -> bool:
        return bool(self.answers)

    def stop(self) -> None:
        """Drop the waiting batches and let the thread end after the one in flight."""
        self._stopped = True
        self._queue.stop()

    def join(self, timeout: float) -> None:
        """Wait at most `timeout` seconds for the thread (if it ever started) to end."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            deadline, batch = item
            self._counters["probes"] += 1
            found: list[bool] | None
            try:
                answers = [bool(f) for f in self._store().probe(batch, deadline)]
                if len(answers) != len(batch):
                    raise ValueError(f"probe answered {len(answers)} of {len(batch)} keys")
                found = answers
            except Exception as exc:  # noqa: BLE001 - a failed probe is an answer: nothing found
                self._counters["probe_failures"] += 1
                self._notice.failed(exc)
                found = None
            else:
                self._notice.recovered()
                self._found_by.remember(batch, answers, deadline)
            self._counters["probes_shed"] = self._queue.shed
            self.answers.append((batch, found))
