"""Plain data types shared by every layer (no torch, no numpy)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import repeat
from typing import TYPE_CHECKING, Any

from kvtier.core.keys import OffloadKey

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.core.specs import LoadStoreSpec

# How a tier's blocks reach the next tier (its `cascade` setting), and the defaults of a tier's
# `cascade` and `reserve` (the low watermark of free-or-clean slots of a cascading tier, as a
# fraction of its capacity). Defined here, the lowest layer, for the config and the manager alike.
CASCADE_MODES = ("on_evict", "on_store", "none")
DEFAULT_CASCADE = "on_evict"
DEFAULT_RESERVE = 0.1

# The default of an option that has none (`Backend.OPTIONS`, the config's own tables): the option must
# be given. Defined here so that backends name it without importing the config layer.
REQUIRED: Any = object()


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
    """Outcome of one transfer job.

    A failed job (`success` False) may name the blocks that failed: `failed_blocks`, positions in
    the job's block order (its specs' order). Then every other block of the job was delivered,
    byte-exact; when it names none (empty), no block of the job may be trusted (`failed_positions`)."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    error: str | None = None
    failed_blocks: tuple[int, ...] = ()

    def failed_positions(self, n: int) -> list[int]:
        """The positions of the blocks of this `n`-block job that were not delivered: none on
        success, `failed_blocks` when the job named them, else every one."""
        if self.success:
            return []
        return sorted(set(self.failed_blocks)) if self.failed_blocks else list(range(n))


@dataclass
class CanonicalKVCacheTensor:
    """One engine KV-cache tensor whose first dimension is the engine block.

    `tensor`: a torch tensor of any dtype, shape `(N, ...)` for `N` engine blocks; each block's
    bytes must be one contiguous run (last dimension contiguous; `stride(0)` may be larger than
    the page, e.g. a view into a bigger buffer).
    `page_size_bytes`: the bytes of one engine block in this tensor that kvtier offloads, at
    most the row stride in bytes. For a block-major `(N, 2, T, H, D)` tensor (K and V, `T` tokens
    per block, `H` KV heads, `D` head dim) it is `2 * T * H * D * tensor.element_size()`, which is
    `tensor[0].numel() * tensor.element_size()`. Example: `N = 1000` blocks of `T = 16` tokens,
    `H = 8` KV heads, `D = 128`, float16 (2 bytes): `2 * 16 * 8 * 128 * 2 = 65,536` bytes per
    block and layer (64 KiB). docs/standalone.md works the example through a whole model.
    """

    tensor: Any
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """One layer's pages in an offloaded block: `page_size_bytes` bytes per engine block of
    `CanonicalKVCaches.tensors[tensor_idx]`.

    `page_size_bytes` is usually that tensor's own `page_size_bytes`; it may be smaller (the
    first bytes of each of its blocks), never larger. Several references (of several groups)
    may name the same tensor.
    """

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """The engine's KV caches: its distinct block tensors and, per KV-cache group, the pages an
    offloaded block holds.

    `tensors`: every distinct KV tensor (typically one per layer).
    `group_data_refs[g]`: the references making up one offloaded block of KV group `g`, in the
    order their pages are laid out in the block (one group for an ordinary decoder, where every
    layer shares the block table; hybrid models have one group per block table). A key's last 4
    bytes name its group (`make_offload_key(block_hash, g)`). Empty means one group holding every
    tensor's full page, in order.

    One offloaded block of group `g` holds, for each reference, `blocks_per_chunk` consecutive
    pages; so its size is `blocks_per_chunk * sum(ref.page_size_bytes for ref in
    group_data_refs[g])`, and a tier's slot is the largest group's size (`KVLayout.block_bytes`,
    kvtier/transfer/handlers/kv_layout.py). `blocks_per_chunk` (an argument of `KVTier.open`, a field of
    `ChunkedKVCaches`; default 1) is how many engine blocks one key covers: with 16-token engine
    blocks and `blocks_per_chunk=16`, one key is one 256-token block.

    `block_tokens` (the YAML's top-level field) changes no byte standalone: the sizes come from
    these pages. It is reported in events and recorded with the layout (dtype, shapes, pages,
    `blocks_per_chunk`) in a file tier's manifest, so reopening a `root_dir` with another
    `block_tokens` or another layout never serves the blocks written before.
    """

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)
