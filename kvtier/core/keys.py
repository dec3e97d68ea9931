"""Block keys: an `OffloadKey` is a block hash followed by a 4-byte big-endian group index.

The encoding is vLLM's (raw bytes, so keys are cheap to hash and compare and never a tuple).
"""

from __future__ import annotations

from typing import NewType

OffloadKey = NewType("OffloadKey", bytes)

GROUP_BYTES = 4  # the group index ends every key
MIN_KEY_BYTES = GROUP_BYTES + 1  # a block hash of one byte or more, then the group index


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an `OffloadKey`."""
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of `key`."""
    return key[:-GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of `key`."""
    return int.from_bytes(key[-GROUP_BYTES:], "big", signed=False)
