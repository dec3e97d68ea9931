"""Store threshold: a block is stored only once it has been offered `threshold` times.

The semantics of vLLM 0.32's `CPUOffloadingManager` (`store_threshold`, `max_tracker_size`), so
that one-time prompts stay out of the tier:

* Every key of every `prepare_store` call is an *offer*, counted in a table of at most
  `max_tracker_size` keys kept in least-recently-offered order. A key already in the table counts
  one more and becomes the most recent; a new key enters with 1, taking the place of the least
  recently offered entry when the table is full. Entries counted again by this call are never
  the ones replaced; when nothing else is left to replace, the new key is not counted.
* A store candidate (a key the cache does not hold) is stored only when its count has reached
  `threshold`; the others are *skipped* (vLLM's `stores_skipped`). Keys the cache holds are not
  filtered: they are the request's reuses, whatever their count.
* A threshold below 2 turns the filter off (no table, nothing skipped), as in vLLM, where 0 is
  the default and 1 equals no filter.

The table holds a 16-byte BLAKE2b digest of each key, never the key (vLLM's holds the keys): its
memory is bounded in bytes whatever the keys' length, about `ENTRY_BYTES` per entry, so ~9 MiB
at the default `max_tracker_size` of 64,000 (the keys themselves could be 64 KiB each: 4 GiB).
Two keys share a count only if their digests collide (odds of 2^-128 per pair).

Pure logic, no vLLM import: used by kvtier's vLLM adapter and by `LRUOffloadingManager`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

DEFAULT_MAX_TRACKER_SIZE = 64_000  # vLLM's default `max_tracker_size`
DIGEST_BYTES = 16  # what the table keeps of a key
ENTRY_BYTES = 140  # about what one table entry costs in CPython 3.11 (tests/test_store_threshold_memory.py)

K = TypeVar("K", bound=bytes)


class StoreThreshold(Generic[K]):
    """Offer counts and the admission filter (see the module docstring). `skipped`: candidates
    skipped so far (cumulative; exporters report its changes)."""

    def __init__(self, threshold: int = 0, max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE) -> None:
        if threshold < 0:
            raise ValueError(f"store_threshold must be 0 or more, got {threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be 1 or more, got {max_tracker_size}")
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        # offers per key digest (`digest`), least recently offered first; None when off
        self.counts: OrderedDict[bytes, int] | None = OrderedDict() if threshold >= 2 else None
        self.enabled = self.counts is not None  # whether the filter is on (threshold 2 or more)
        self.skipped = 0

    def count(self, key: K) -> int:
        """How many offers of `key` the table holds (0 when it holds none)."""
        return 0 if self.counts is None else self.counts.get(digest(key), 0)

    def admit(self, keys: Sequence[K], absent: Collection[K]) -> list[K]:
        """Count the offer `keys`, then return them without the skipped ones: those in `absent`
        (the store candidates) offered fewer than `threshold` times. All of `keys` when off."""
        if self.counts is None:
            return list(keys)
        digests = [digest(key) for key in keys]
        self._record(digests)
        admitted = self._passing(keys, digests, absent)
        self.skipped += len(keys) - len(admitted)
        return admitted

    def passes(self, keys: Sequence[K], absent: Collection[K]) -> list[K]:
        """`keys` less the candidates (in `absent`) offered fewer than `threshold` times so far,
        without counting an offer (a caller asking again about an offer already counted)."""
        if self.counts is None:
            return list(keys)
        return self._passing(keys, [digest(key) for key in keys], absent)

    def _passing(self, keys: Sequence[K], digests: Sequence[bytes], absent: Collection[K]) -> list[K]:
        """The filter `admit` and `passes` share: `keys` (with their `digests`) held already, or offered
        `threshold` times."""
        counts, threshold = self.counts, self.threshold
        assert counts is not None
        return [key for key, d in zip(keys, digests) if key not in absent or counts.get(d, 0) >= threshold]

    def _record(self, keys: Sequence[bytes]) -> None:
        """Count one offer of each of `keys` (digests; vLLM's `_record_accesses`, step for step)."""
        counts = self.counts
        assert counts is not None
        counted_again: set[bytes] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                counted_again.add(key)
        replaceable = len(counts) - len(counted_again)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if replaceable == 0:
                    continue
                counts.popitem(last=False)
                replaceable -= 1
            counts[key] = 1


def digest(key: bytes) -> bytes:
    """What the table keeps of `key`: `DIGEST_BYTES` of BLAKE2b."""
    return hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()
