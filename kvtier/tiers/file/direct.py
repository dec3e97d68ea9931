"""The file tier's direct (device) path: for a caller that moves payloads itself.

kvtier/transfer/handlers/gpu_file.py moves payloads with kvikio between GPU memory and the slab: it writes
and reads them at `payload_offset(slot)` (4 KiB-aligned), then `commit_direct` (after a write) or
`read_headers` before a read and `reject` for the blocks that fail verification. `FileBackend`
offers one as `direct_path`; a FILE backend without one is served through host staging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.core.errors import IntegrityError, KVTierError
from kvtier.tiers.file.commit_log import CommitLog
from kvtier.tiers.file.slab import SlabIO, check_slots
from kvtier.tiers.file.slot_format import HEADER_BYTES, SlotHeader


class DirectPath:
    """The slot headers and commits of payloads that a caller moved itself, exactly as the file
    tier's own `write_blocks` / `read_blocks` would write and check them."""

    def __init__(self, tier: str, num_blocks: int, slot_bytes: int, slab_path: Path, slab: SlabIO,
                 commits: CommitLog, is_closed: Callable[[], bool]):
        self.tier = tier
        self.num_blocks = num_blocks
        self.slot_bytes = slot_bytes
        self.slab_path = slab_path
        self._slab = slab
        self._commits = commits
        self._is_closed = is_closed

    def payload_offset(self, slot: int) -> int:
        """Byte offset of `slot`'s payload in `slab_path` (a multiple of 4 KiB)."""
        return slot * self.slot_bytes + HEADER_BYTES

    def commit_direct(self, slots: Sequence[int], keys: Sequence[bytes], checks: Sequence[int], kind: int) -> None:
        """After the caller wrote the payloads of `slots` (and waited for them): write their
        header pages, carrying the payload checksums `checks` of `kind` (slot_format.CHECK_*),
        then journal them, exactly as `write_blocks` would have."""
        self._check_open()
        check_slots(slots, keys, self.num_blocks)
        self._slab.write_headers(slots, keys, checks, kind)
        self._commits.commit([(slot, bytes(key), check) for slot, key, check in zip(slots, keys, checks)])

    def read_headers(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[SlotHeader | str]:
        """Before the caller reads the payloads of `slots`: each slot's header if it may describe
        the block `keys[i]` (its `check_kind` and `payload_crc` say how to verify the payload),
        else why not (then pass it to `reject`)."""
        self._check_open()
        check_slots(slots, keys, self.num_blocks)
        return self._slab.read_headers(slots, keys)

    def reject(self, bad: Sequence[tuple[int, str]]) -> IntegrityError:
        """Forget the blocks of the (slot, why) that failed verification (never served again, not
        found by a restart); the `IntegrityError` that names them, for the caller to raise."""
        self._commits.forget([slot for slot, _why in bad])
        detail = "; ".join(f"slot {s}: {why}" for s, why in bad[:8])
        return IntegrityError(f"file tier {self.tier}: {len(bad)} block(s) in {self.slab_path} failed "
                              f"verification and will not be served ({detail})", [slot for slot, _why in bad])

    def _check_open(self) -> None:
        if self._is_closed():
            raise KVTierError(f"file tier {self.tier} is closed")
