"""Plain data types shared by every layer (no torch, no numpy)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import repeat
from typing import TYPE_CHECKING, Any

from kvtier.keys import OffloadKey

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.specs import LoadStoreSpec

# How a tier's blocks reach the next tier (its `cascade` setting), and the defaults of a tier's
# `cascade` and `reserve` (the low watermark of free-or-clean slots of a cascading tier, as a
# fraction of its capacity). Defined here, the lowest layer, for the config and the manager alike.
CASCADE_MODES = ("on_evict", "on_store", "none")
DEFAULT_CASCADE = "on_evict"
DEFAULT_RESERVE = 0.1


class BlockStatus(ctypes.Structure):
    """Residence status of one block in one tier.

    ``ref_cnt`` is -1 while the block is being written (not readable), 0 when it is readable and
    evictable, and > 0 while that many transfers read it (pinned: never evicted).
    ``block_id`` is the slot index inside the tier's backend.
    """

    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int = 0):
        super().__init__()
        self.ref_cnt = -1
        self.block_id = block_id

    @classmethod
    def many(cls, block_ids: Iterable[int]) -> list[BlockStatus]:
        """`[BlockStatus(i) for i in block_ids]` (being written, ref_cnt -1), built in C loops
        from a packed image of the fields instead of one `__init__` call per block."""
        return list(map(cls.from_buffer_copy, map(_PACK_WRITING, repeat(-1), block_ids)))

    @property
    def is_ready(self) -> bool:
        """Whether the block can be read."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


# The in-memory image of a BlockStatus: ref_cnt (int32), padding, block_id (int64), native order.
_PACK_WRITING = struct.Struct("=i4xq").pack
assert struct.calcsize("=i4xq") == ctypes.sizeof(BlockStatus) and vars(BlockStatus)["block_id"].offset == 8


class LookupResult(Enum):
    """Answer of `OffloadingManager.lookup` for one block."""

    MISS = auto()  # not held anywhere
    HIT = auto()  # readable now
    HIT_PENDING = auto()  # held but still being written; ask again later, counts as a hit
    RETRY = auto()  # being brought closer (promotion); ask again later


@dataclass
class ReqContext:
    """Per-request context passed to every manager call (vLLM's `ReqContext`, the fields we use)."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class RequestOffloadingContext:
    """How a request's blocks should be offloaded (returned by `on_new_request`)."""

    request_level: bool = False


@dataclass
class PrepareStoreOutput:
    """Result of `prepare_store`: which keys to write, where, and which keys left the tier."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """A change of residence of some blocks in one medium (`removed` False = stored)."""

    keys: list[OffloadKey]
    block_size: int
    medium: str
    removed: bool
    tier: str | None = None


@dataclass
class TransferResult:
    """Outcome of one transfer job."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: str | None = None


@dataclass
class CanonicalKVCacheTensor:
    """One KV-cache tensor whose first dimension is the number of blocks (bytes per block = page)."""

    tensor: Any
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """Reference from a layer (or group of layers) to a `CanonicalKVCacheTensor` by index."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """The KV caches as unique block tensors plus, per KV group, references into them."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)
