"""`LoadStoreSpec`s: where some blocks' bytes are in one medium.

A handler is registered per (source spec type, destination spec type); the router picks it from
the types of the two specs of a job. Specs that name a tier (`tier`) let one handler serve several
tiers of the same kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TypeVar

from kvtier.core.keys import OffloadKey


class LoadStoreSpec(ABC):
    """Where the bytes of some blocks are (or will be written) in one medium."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium this spec addresses (`"GPU"`, `"CPU"`, `"FILE"`, ...)."""

    def __len__(self) -> int:  # pragma: no cover - every concrete spec overrides
        raise NotImplementedError

    def subset(self, positions: Sequence[int]) -> LoadStoreSpec:
        """The same kind of spec restricted to `positions` (needed to split a multi-tier job).
        Default: this spec cannot be split (`TypeError`)."""
        raise TypeError(f"{type(self).__name__} cannot be split by position (it has no subset())")


_Spec = TypeVar("_Spec", bound="BlockIDsLoadStoreSpec")


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Blocks addressed by slot numbers inside one tier (`tier` names it, None = the only one)."""

    __slots__ = ("block_ids", "tier")

    def __init__(self, block_ids: Iterable[int], tier: str | None = None):
        self.block_ids: list[int] = list(map(int, block_ids))
        if self.block_ids and min(self.block_ids) < 0:
            raise ValueError(f"block_ids must be >= 0, got {self.block_ids}")
        self.tier = tier

    def __len__(self) -> int:
        return len(self.block_ids)

    @classmethod
    def for_blocks(cls, block_ids: Sequence[int], keys: Sequence[OffloadKey], tier: str | None = None):
        """A spec for `block_ids` holding `keys` (specs that record keys override this)."""
        return cls(block_ids, tier=tier)

    def subset(self: _Spec, positions: Sequence[int]) -> _Spec:
        """The same kind of spec restricted to `positions` (indices into `block_ids`)."""
        clone = object.__new__(type(self))
        clone.block_ids = [self.block_ids[p] for p in positions]
        clone.tier = self.tier
        return clone

    def __repr__(self) -> str:
        where = f", tier={self.tier!r}" if self.tier else ""
        return f"{type(self).__name__}({self.block_ids}{where})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slots of a CPU (host memory) tier."""

    @staticmethod
    def medium() -> str:
        return "CPU"


class KeyedLoadStoreSpec(BlockIDsLoadStoreSpec, ABC):
    """Slots of a tier that records each block's key with its bytes (a file slot's header, a
    server's key): `keys[i]` is the key of the block in slot `block_ids[i]`."""

    __slots__ = ("keys",)

    def __init__(self, block_ids: Sequence[int], keys: Sequence[OffloadKey], tier: str | None = None):
        super().__init__(block_ids, tier)
        if len(keys) != len(self.block_ids):
            raise ValueError(f"{type(self).__name__}: {len(keys)} keys for {len(self.block_ids)} block_ids")
        self.keys: list[OffloadKey] = list(keys)

    @classmethod
    def for_blocks(cls, block_ids: Sequence[int], keys: Sequence[OffloadKey], tier: str | None = None):
        return cls(block_ids, keys, tier=tier)

    def subset(self, positions: Sequence[int]) -> KeyedLoadStoreSpec:
        clone = super().subset(positions)
        clone.keys = [self.keys[p] for p in positions]
        return clone


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Blocks of the engine's KV cache (GPU memory, or CPU tensors when the engine runs on CPU).

    With several KV groups the block ids are ordered by group and `group_sizes[i]` ids belong to
    group i (`sum(group_sizes) == len(block_ids)`); `None` means one group. `block_indices[i]` is
    the logical index (in the request) of group i's first block: when an offloaded block spans
    several engine blocks, the first engine block of a load may start inside an offloaded block,
    and the handler skips `block_indices[i] % blocks_per_offloaded_block` sub-blocks of it.
    """

    __slots__ = ("group_sizes", "block_indices")

    def __init__(
        self,
        block_ids: Iterable[int],  # ints, or a numpy array of them (vLLM's specs)
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ):
        super().__init__(block_ids)
        n = len(self.block_ids)
        sizes = [n] if group_sizes is None else [int(s) for s in group_sizes]
        if any(s < 0 for s in sizes):
            raise ValueError(f"GPULoadStoreSpec: group_sizes must be >= 0, got {sizes}")
        if sum(sizes) != n:
            raise ValueError(
                f"GPULoadStoreSpec: sum(group_sizes)={sum(sizes)} must equal len(block_ids)={n} "
                f"(group_sizes={sizes})"
            )
        if block_indices is not None:
            block_indices = [int(i) for i in block_indices]
            if len(block_indices) != len(sizes):
                raise ValueError(
                    f"GPULoadStoreSpec: len(block_indices)={len(block_indices)} must equal the number "
                    f"of groups {len(sizes)} (one starting index per group)"
                )
            if any(i < 0 for i in block_indices):
                raise ValueError(f"GPULoadStoreSpec: block_indices must be >= 0, got {block_indices}")
        self.group_sizes: list[int] = sizes
        self.block_indices: list[int] | None = block_indices

    def subset(self, positions: Sequence[int]) -> GPULoadStoreSpec:
        """Not defined: an offloaded block may cover several engine blocks (and the first one
        partly), so key positions do not map to block ids. Build one spec per part instead."""
        raise TypeError("GPULoadStoreSpec cannot be split by key position; build one engine-side spec per part")

    @staticmethod
    def medium() -> str:
        return "GPU"


class PartsLoadStoreSpec(LoadStoreSpec):
    """Blocks from several sources: `parts[i] = (spec, positions)` where `positions` are the
    indices, in the original key order, of the blocks `spec` addresses (the shape of
    `CompositeLoadStoreSpec`, and of a handler's own multi-source job)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[tuple[LoadStoreSpec, Sequence[int]]]):
        self.parts = [(spec, list(pos)) for spec, pos in parts]

    def __len__(self) -> int:
        return sum(len(p) for _, p in self.parts)

    @staticmethod
    def medium() -> str:
        return "MIXED"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.parts})"


class CompositeLoadStoreSpec(PartsLoadStoreSpec):
    """A load whose blocks come from several tiers (`PartsLoadStoreSpec`): the router splits it
    into one job per part."""

    __slots__ = ()
