"""Backends without real storage devices: `SlotBackend` (no bytes, for trace replay) and
`MemoryBackend` (an anonymous-mapping arena, for tests and the in-memory handler)."""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtier.core.specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec
from kvtier.tiers import room
from kvtier.tiers.base import HOST_HANDLERS, Backend


class SlotBackend(Backend):
    """Tracks slots only; stands in for any backend when transfers carry no bytes."""

    spec_type: ClassVar[type[BlockIDsLoadStoreSpec]] = CPULoadStoreSpec
    medium: ClassVar[str] = "CPU"

    def __init__(self, name: str, num_blocks: int, block_bytes: int = 0, block_size: int = 0,
                 spec_type: type[BlockIDsLoadStoreSpec] | None = None):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if spec_type is not None:
            # A stand-in answers as the backend it stands for, so these two are per instance here
            # (class-level on every real backend, where Backend's ClassVar declarations are right).
            self.spec_type = spec_type  # type: ignore[misc]
            self.medium = spec_type.medium()  # type: ignore[misc]

    def close(self) -> None:
        return


class MemoryBackend(Backend):
    """Blocks in one process-local, page-aligned anonymous mapping (`num_blocks * block_bytes`),
    slots back to back: a `HostRegion` (`view(slot)`, `tensor()`, `slot_stride == block_bytes`).

    Page alignment keeps behaviour independent of where the allocator puts the arena: the file
    tier's zero-copy O_DIRECT path depends on buffer alignment."""

    spec_type = CPULoadStoreSpec
    medium = "CPU"
    handlers = HOST_HANDLERS
    max_blocks = None  # bounded by memory (capacity_problem)

    @classmethod
    def capacity_problem(cls, need_bytes: int, options: Mapping[str, Any]) -> str | None:
        """The arena must fit in the available memory."""
        return room.memory_problem(need_bytes)

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0):
        super().__init__(name, num_blocks, block_bytes, block_size)
        if block_bytes <= 0:
            raise ValueError(f"MemoryBackend {name!r} needs block_bytes > 0, got {block_bytes}")
        self.slot_stride = block_bytes
        self.arena = mmap.mmap(-1, num_blocks * block_bytes)
        self._view = memoryview(self.arena)
        self._tensor = None

    def view(self, slot: int) -> memoryview:
        start = slot * self.block_bytes
        return self._view[start:start + self.block_bytes]

    def tensor(self):
        """A uint8 tensor `(num_blocks, block_bytes)` over the arena, no copy (imports torch)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self.arena, dtype=torch.uint8).view(self.num_blocks, self.block_bytes)
        return self._tensor

    def close(self) -> None:
        self._view.release()
