"""The standalone Python API: a hierarchy around a set of KV tensors, blocks stored and loaded by key.

    with KVTier.open("cpu-file.yaml", kv_caches, model="org/model@revision") as tier:
        tier.store(keys, engine_block_ids)        # engine blocks -> tier 0 (cascades below)
        n = tier.load(keys, engine_block_ids)     # the first n keys were loaded into those blocks

`model` names the model whose KV this is; a file tier records it with the KV layout and never
serves blocks written under another model or layout (see `KVTier.open`).

Both planes live in this process: the hierarchy's manager (control plane, scheduler side) and a
private `TransferEngine` for the jobs that touch the KV tensors (worker side), exactly as vLLM
splits them across processes. Every call returns when its bytes have moved.

Keys are `OffloadKey`s (block hash + 4-byte big-endian group index); with several KV groups the
group of a key selects the group's layout. One key covers `blocks_per_chunk` engine blocks, so
`engine_block_ids` has `len(keys) * blocks_per_chunk` entries, key after key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.config import HierarchyConfig, load_config
from kvtier.engine import TransferEngine
from kvtier.handlers.gpu_cpu import ChunkedKVCaches, KVLayout
from kvtier.hierarchy import Hierarchy, build_hierarchy
from kvtier.keys import get_offload_group_idx
from kvtier.specs import (BlockIDsLoadStoreSpec, CompositeLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec)
from kvtier.types import CanonicalKVCaches, LookupResult, TransferResult

_MAX_LOOKUP_ROUNDS = 1000


class KVTier:
    """A running hierarchy bound to one set of KV tensors. Not thread-safe: one caller at a time."""

    def __init__(self, hierarchy: Hierarchy, layout: KVLayout):
        self.hierarchy = hierarchy
        self.manager = hierarchy.manager
        self.layout = layout
        self.blocks_per_chunk = layout.blocks_per_chunk
        # The handlers that touch the KV tensors report to a private engine (the worker plane),
        # so that the manager's polling never swallows their results.
        self._worker = TransferEngine()
        for src, dst in hierarchy.engine.pairs():
            if GPULoadStoreSpec in (src, dst):
                self._worker.register(src, dst, hierarchy.engine.handler_for(src, dst))
        self._results: dict[int, TransferResult] = {}
        self._counters = {"stores": 0, "store_failures": 0, "store_bytes": 0, "store_seconds": 0.0,
                          "loads": 0, "load_failures": 0, "load_bytes": 0, "load_seconds": 0.0}
        self._closed = False

    @classmethod
    def open(cls, config: str | Path | HierarchyConfig, kv_caches: CanonicalKVCaches,
             blocks_per_chunk: int = 1, *, model: str = "", **build_options: Any) -> "KVTier":
        """Build the hierarchy of `config` (a YAML path or a `HierarchyConfig`) around `kv_caches`.

        The block size in bytes is derived from the KV layout (see `kvtier.handlers.gpu_cpu`).
        `model` identifies the model whose KV this is, e.g. `"meta-llama/Llama-3.1-8B@<revision>"`:
        required when a tier keeps blocks across restarts (`file`) and its config sets no
        `fingerprint`. Such a tier records it with the layout of `kv_caches` (dtypes, shapes,
        pages, block geometry) and serves nothing written under another identity or layout.
        `build_options` go to `build_hierarchy` (e.g. `enable_events=True`).
        """
        if not isinstance(config, HierarchyConfig):
            config = load_config(config)
        chunked = ChunkedKVCaches(list(kv_caches.tensors), list(kv_caches.group_data_refs), blocks_per_chunk)
        layout = KVLayout(chunked, blocks_per_chunk)
        hierarchy = build_hierarchy(config, block_bytes=layout.block_bytes, kv_caches=chunked, model=model,
                                    **build_options)
        try:
            return cls(hierarchy, layout)
        except BaseException:
            hierarchy.close()
            raise

    # ------------------------------------------------------------------ public API
    def store(self, keys: Sequence[bytes], engine_block_ids: Sequence[int]) -> bool:
        """Copy the engine blocks of `keys` into the hierarchy. Keys already held are skipped.
        Returns False when some blocks could not be stored (no room, or the copy failed).

        With a cascading first tier, blocks go in batches no larger than its free-or-clean room,
        waiting for background demotions in between, so no block is evicted before it is safe
        below (the manager alone would drop it: it never waits, as vLLM's scheduler must not).
        """
        self._check_open()
        by_key = self._blocks_by_key(keys, engine_block_ids)
        top = self.manager.tiers[0]
        cascading = len(self.manager.tiers) > 1 and top.cascade == "on_evict"
        pending = [key for key in keys if top.policy.get(key) is None]
        ok = True
        while pending:
            n = len(pending)
            if cascading:
                if self._room() < n:
                    self.manager.on_schedule_end()
                    self.manager.wait_idle()
                n = max(1, min(n, self._room()))
            batch, pending = pending[:n], pending[n:]
            ok &= self._store_batch(batch, by_key)
        return ok

    def _room(self) -> int:
        top = self.manager.tiers[0]
        return top.backend.get_num_free_blocks() + len(top.clean)

    def _store_batch(self, keys: list[bytes], by_key: dict[bytes, list[int]]) -> bool:
        output = self.manager.prepare_store(keys)
        if output is None and self.manager.has_pending_work():
            # Room is being made by background demotions (pinned while in flight): wait for them.
            self.manager.wait_idle()
            output = self.manager.prepare_store(keys)
        if output is None:
            return False
        to_store = list(output.keys_to_store)
        if not to_store:
            return True
        order = self._group_order(to_store)
        result = self._run(self._gpu_spec([to_store[i] for i in order], by_key), output.store_spec.subset(order))
        self.manager.complete_store(to_store, success=result.success)
        self._count("store", result)
        return result.success

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` can be loaded now. Blocks found in a lower tier are brought up
        first when no handler loads them directly (this call waits for that)."""
        self._check_open()
        for _ in range(_MAX_LOOKUP_ROUNDS):
            hits, again = 0, False
            for key in keys:
                answer = self.manager.lookup(key)
                if answer is LookupResult.HIT:
                    hits += 1
                    continue
                again = answer in (LookupResult.RETRY, LookupResult.HIT_PENDING)
                break
            if not again:
                return hits
            self.manager.on_schedule_end()
            self.manager.wait_idle()
        return hits

    def load(self, keys: Sequence[bytes], engine_block_ids: Sequence[int]) -> int:
        """Load the longest loadable prefix of `keys` into its engine blocks; returns how many keys
        were loaded (0 when the copy failed: the caller must then recompute those blocks)."""
        self._check_open()
        by_key = self._blocks_by_key(keys, engine_block_ids)
        n = self.lookup(keys)
        if n == 0:
            return 0
        wanted = list(keys[:n])
        source = self.manager.prepare_load(wanted)
        try:
            parts = source.parts if isinstance(source, CompositeLoadStoreSpec) else [(source, range(n))]
            ok, moved, seconds = True, 0, 0.0
            for spec, positions in parts:  # one job per source tier
                positions = list(positions)
                part_keys = [wanted[p] for p in positions]
                order = self._group_order(part_keys)
                assert isinstance(spec, BlockIDsLoadStoreSpec)
                result = self._run(spec.subset(order), self._gpu_spec([part_keys[i] for i in order], by_key))
                ok &= result.success
                moved += result.transfer_size or 0
                seconds += result.transfer_time or 0.0
        finally:
            self.manager.complete_load(wanted)
        self._count("load", TransferResult(0, ok, moved, seconds))
        return n if ok else 0

    def wait(self) -> None:
        """Block until every background job (cascades, promotions) has finished."""
        self._check_open()
        self.manager.wait_idle()
        self._worker.wait()

    def stats(self) -> dict[str, Any]:
        """Per-tier counters of the manager plus this API's store/load totals under `"engine"`."""
        return {**self.manager.get_stats(), "engine": dict(self._counters)}

    def close(self) -> None:
        """Finish background jobs and release every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.hierarchy.close()

    def __enter__(self) -> "KVTier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVTier is closed")

    def _blocks_by_key(self, keys: Sequence[bytes], engine_block_ids: Sequence[int]) -> dict[bytes, list[int]]:
        bpc = self.blocks_per_chunk
        ids = [int(b) for b in engine_block_ids]
        if len(ids) != len(keys) * bpc:
            raise ValueError(f"{len(keys)} keys need {len(keys) * bpc} engine block ids "
                             f"(blocks_per_chunk={bpc}), got {len(ids)}")
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys")
        return {key: ids[i * bpc:(i + 1) * bpc] for i, key in enumerate(keys)}

    def _group(self, key: bytes) -> int:
        if len(self.layout.groups) == 1:
            return 0
        group = get_offload_group_idx(key)
        if group >= len(self.layout.groups):
            raise ValueError(f"key {key.hex()} names KV group {group}, the cache has {len(self.layout.groups)}")
        return group

    def _group_order(self, keys: Sequence[bytes]) -> list[int]:
        """Positions of `keys` ordered by KV group (stable), as a `GPULoadStoreSpec` lists blocks."""
        return sorted(range(len(keys)), key=lambda i: self._group(keys[i]))

    def _gpu_spec(self, keys: Sequence[bytes], by_key: dict[bytes, list[int]]) -> GPULoadStoreSpec:
        """Engine blocks of `keys` (already ordered by group), whole chunks (no skipped sub-blocks)."""
        sizes = [0] * len(self.layout.groups)
        ids: list[int] = []
        for key in keys:
            sizes[self._group(key)] += self.blocks_per_chunk
            ids.extend(by_key[key])
        return GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=[0] * len(sizes))

    def _run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferResult:
        """Submit one job to the worker plane and wait for its result."""
        job_id = self._worker.submit(src, dst)
        while job_id not in self._results:
            self._worker.wait([job_id])
            for result in self._worker.poll():
                self._results[result.job_id] = result
            if job_id not in self._results:
                time.sleep(0.0005)  # the result is reported just after the job's future completes
        return self._results.pop(job_id)

    def _count(self, kind: str, result: TransferResult) -> None:
        c = self._counters
        if result.success:
            c[f"{kind}s"] += 1
            c[f"{kind}_bytes"] += result.transfer_size or 0
            c[f"{kind}_seconds"] += result.transfer_time or 0.0
        else:
            c[f"{kind}_failures"] += 1
