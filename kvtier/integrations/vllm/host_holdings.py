"""`Holdings`: what one vLLM engine holds in the host owner, by connection.

A `prepare_load` pins keys in the owner and a `prepare_store` starts stores there, each granted to
one connection (`HostClient.generation`): after a reconnection the old ones are the old owner's
(a restarted owner never granted them; a lost connection's are released by the owner), so they
are completed only with the generation that granted them. A cache reset moves what is in flight
aside (`reset`): the engine never completes it, and it is released once no worker uses it any
more (`take_flushed`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey


class Holdings:
    """Pins (one per `prepare_load`, oldest first) and stores in flight, each with the generation
    of the connection that got it, and those in flight at the last reset (the module docstring)."""

    def __init__(self) -> None:
        self._pins: dict[OffloadKey, list[int]] = {}  # key -> generation of each pin held, oldest first
        self._storing: dict[OffloadKey, int] = {}  # key -> generation of its store in flight
        self._flushed: tuple[dict[OffloadKey, list[int]], dict[OffloadKey, int]] = ({}, {})
        self.flushed_at = 0.0  # when the last reset left transfers in flight

    def pinned(self, keys: Iterable[OffloadKey], generation: int) -> None:
        for key in keys:
            self._pins.setdefault(key, []).append(generation)

    def unpin(self, keys: Iterable[OffloadKey], generation: int) -> list[OffloadKey]:
        """Drop one pin of each of `keys`; those the connection `generation` holds (to release)."""
        held, pins = [], self._pins
        for key in keys:
            generations = pins.get(key)
            if not generations:
                continue
            if generations.pop(0) == generation:
                held.append(key)
            if not generations:
                del pins[key]
        return held

    def storing(self, keys: Iterable[OffloadKey], generation: int) -> None:
        self._storing.update(dict.fromkeys(keys, generation))

    def stored(self, keys: Iterable[OffloadKey], generation: int) -> list[OffloadKey]:
        """Forget the stores of `keys`; those the connection `generation` started (to complete)."""
        return [key for key in keys if self._storing.pop(key, None) == generation]

    def reset(self) -> None:
        """A cache reset: what is in flight is set aside until `take_flushed`."""
        self.flushed_at = time.monotonic()
        pins, storing = self._flushed
        for key, generations in self._pins.items():
            pins.setdefault(key, []).extend(generations)
        storing.update(self._storing)
        self._pins, self._storing = {}, {}

    @property
    def flushed(self) -> bool:
        """Whether transfers in flight at a reset are still set aside."""
        return bool(self._flushed[0] or self._flushed[1])

    def take_flushed(self, generation: int) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """Forget what was set aside at resets: (its pins, its stores) that `generation` holds."""
        pins, storing = self._flushed
        self._flushed = ({}, {})
        return ([key for key, generations in pins.items() for g in generations if g == generation],
                [key for key, g in storing.items() if g == generation])
