"""The keys and engine block ids of `KVTier` calls: checked against one hierarchy and KV layout,
and laid out the way a `GPULoadStoreSpec` lists blocks (by KV group, whole chunks).

The checks are the ones the `kvtier.standalone` module docstring lists; each failure is an
`ArgumentError` naming the argument and position (`keys[3]`, `engine_block_ids[7]`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from kvtier.core.errors import ArgumentError
from kvtier.core.keys import GROUP_BYTES, MIN_KEY_BYTES, OffloadKey, get_offload_group_idx
from kvtier.core.specs import GPULoadStoreSpec
from kvtier.standalone.args import as_ids, as_key, as_list, raise_duplicate
from kvtier.transfer.handlers.gpu_cpu import KVLayout


class KeyBlocks:
    """Checks and lays out the keys and engine blocks of calls on one `layout`; `key_limit` is
    `Hierarchy.key_limit` of the hierarchy (the longest key it holds, and which tier says so)."""

    def __init__(self, layout: KVLayout, key_limit: tuple[float, str]):
        self.layout = layout
        self.blocks_per_chunk = layout.blocks_per_chunk
        self._key_limit = key_limit

    def keys(self, keys: Iterable[bytes], distinct: bool) -> list[OffloadKey]:
        """`keys` as a list of `bytes` this hierarchy can hold, or an `ArgumentError` naming the first bad one."""
        keys = as_list(keys, "keys", "[key]")
        if set(map(type, keys)) - {bytes}:
            keys = [as_key(key, i) for i, key in enumerate(keys)]
        if keys:
            limit, holder = self._key_limit
            lengths = set(map(len, keys))
            if min(lengths) < MIN_KEY_BYTES or max(lengths) > limit:
                i, key = next((i, k) for i, k in enumerate(keys) if not MIN_KEY_BYTES <= len(k) <= limit)
                raise ArgumentError(f"keys[{i}]: key of {len(key)} bytes is shorter than {MIN_KEY_BYTES}: a key is a "
                                    f"block hash (1 byte or more) plus a {GROUP_BYTES}-byte group index "
                                    "(kvtier.make_offload_key)" if len(key) < MIN_KEY_BYTES else
                                    f"keys[{i}]: key of {len(key)} bytes is longer than the {limit} bytes "
                                    f"{holder} can hold (its max_key_bytes); use a shorter block hash")
        if len(self.layout.groups) > 1:
            for i, key in enumerate(keys):
                self.check_group(key, i)
        if distinct and len(set(keys)) != len(keys):
            raise_duplicate(keys, "keys", "each key can be given once per call")
        return cast("list[OffloadKey]", keys)  # checked above: each one is a key this hierarchy can hold

    def check_group(self, key: OffloadKey, i: int) -> None:
        n = len(self.layout.groups)
        if len(key) < GROUP_BYTES or get_offload_group_idx(key) >= n:
            raise ArgumentError(f"keys[{i}]: names no KV group of the {n} (0..{n - 1}): a key ends with a "
                                f"{GROUP_BYTES}-byte big-endian group index, this one ends with "
                                f"{key[-GROUP_BYTES:].hex() or 'nothing'} (kvtier.make_offload_key)")

    def blocks_by_key(self, keys: list[OffloadKey], engine_block_ids: Iterable[int],
                      distinct: bool) -> dict[OffloadKey, list[int]]:
        """The engine blocks of each key, checked (see the module docstring); `distinct`: no id twice."""
        bpc, num_blocks = self.blocks_per_chunk, self.layout.num_engine_blocks
        ids = as_ids(engine_block_ids)
        if len(ids) != len(keys) * bpc:
            raise ArgumentError(f"engine_block_ids: {len(ids)} ids for {len(keys)} keys; each key covers "
                                f"blocks_per_chunk={bpc} engine blocks, so {len(keys) * bpc} engine block ids "
                                "are needed")
        if ids and (min(ids) < 0 or max(ids) >= num_blocks):
            i, block = next((i, b) for i, b in enumerate(ids) if not 0 <= b < num_blocks)
            raise ArgumentError(f"engine_block_ids[{i}]: {block} is not an engine block: the KV tensors "
                                f"have {num_blocks} blocks, ids 0..{num_blocks - 1}")
        if distinct and len(set(ids)) != len(ids):
            raise_duplicate(ids, "engine_block_ids", "a load writes each engine block once")
        if bpc == 1:
            return {key: [block] for key, block in zip(keys, ids)}
        return {key: ids[i * bpc:(i + 1) * bpc] for i, key in enumerate(keys)}

    def group(self, key: OffloadKey) -> int:
        """The KV group of a checked key."""
        return 0 if len(self.layout.groups) == 1 else get_offload_group_idx(key)

    def group_order(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Positions of `keys` ordered by KV group (stable), as a `GPULoadStoreSpec` lists blocks."""
        return sorted(range(len(keys)), key=lambda i: self.group(keys[i]))

    def gpu_spec(self, keys: Sequence[OffloadKey], by_key: dict[OffloadKey, list[int]]) -> GPULoadStoreSpec:
        """Engine blocks of `keys` (already ordered by group), whole chunks (no skipped sub-blocks)."""
        sizes = [0] * len(self.layout.groups)
        ids: list[int] = []
        for key in keys:
            sizes[self.group(key)] += self.blocks_per_chunk
            ids.extend(by_key[key])
        return GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=[0] * len(sizes))
