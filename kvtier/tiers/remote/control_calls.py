"""`ControlCalls`: what the control plane (kvtier/control/shared_probes.py) asks of the shared tier besides
the Backend API and the handle bookkeeping: probes (answered on the backend's probe thread) and
whether writes are paused. A mixin of `ValkeyBackend`, which holds the `Probes` and `WritePause`
it reads (`_probes`, `_writes`); every call here reads state or hands off work, never touches a
socket, so the manager may make it on the scheduler thread."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.tiers.remote.probes import Probes
from kvtier.tiers.remote.runtime import WritePause


class ControlCalls:
    _probes: Probes
    _writes: WritePause

    def request_probe(self, keys: Sequence[bytes]) -> None:
        """Hand one batch to the probe thread, to be answered within `timeout_ms` (never blocks;
        answered by `probe_results`, or dropped unsent when newer batches push it out or its deadline
        passes first: its lookups were answered MISS at that deadline)."""
        self._probes.request(list(keys))

    def probe_results(self) -> list[tuple[list[bytes], list[bool] | None]]:
        """The batches answered since the last call: `(keys, found)`, `found` None when the probe failed."""
        return self._probes.results()

    @property
    def has_probe_results(self) -> bool:
        return self._probes.answered

    @property
    def queued_probes(self) -> int:
        """Batches waiting for the probe thread, not counting the one in flight: at most
        `kvtier.tiers.remote.runtime.MAX_QUEUED`, however slow the server."""
        return len(self._probes)

    def accepts_writes(self) -> bool:
        """False for `breaker_open_s` after a slow write (see `SLOW_WRITE_FRACTION`) or a failed one."""
        return self._writes.accepts(time.monotonic())

    def take_unsent(self, keys: Sequence[bytes]) -> list[bytes]:
        """Which of a finished publish job's `keys` were not written (writes paused or failed)."""
        return self._writes.take_unsent(keys)
