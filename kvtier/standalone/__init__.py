"""The standalone Python API: a hierarchy around a set of KV tensors, blocks stored and loaded by key.

    with KVTier.open("cpu-file.yaml", kv_caches, model="org/model@revision") as tier:
        tier.store(keys, engine_block_ids)        # engine blocks -> tier 0 (cascades below)
        n = tier.load(keys, engine_block_ids)     # the first n keys were loaded into those blocks

`model` names the model whose KV this is; a file tier records it with the KV layout and never
serves blocks written under another model or layout (see `KVTier.open`).

Both planes the builder returns live in this process: the hierarchy's manager (control plane,
scheduler side) and its worker plane (`kvtier.transfer.planes.WorkerPlane`: the jobs that touch the KV
tensors, worker side), as vLLM splits them across processes. Every call returns when its bytes
have moved; calls from several threads run one at a time (`KVTier`). `store` and `load` take any
number of keys (rounds of the first tier's room); `flush` (and `close`, by default) writes the
blocks not yet below to the next tier, so a restart on the same file tier finds them.

Keys are `OffloadKey`s (block hash + 4-byte big-endian group index); with several KV groups the
group of a key selects the group's layout. One key covers `blocks_per_chunk` engine blocks, so
`engine_block_ids` has `len(keys) * blocks_per_chunk` entries, key after key.

Arguments are checked at the call, before anything is allocated or copied: what the hierarchy could
not honour later is refused at once with an `ArgumentError` (a `KVTierError` and a `ValueError`; an
`ArgumentTypeError` is also a `TypeError`) that names the argument, e.g. `keys[3]` or
`engine_block_ids[7]`:
- `keys`: a sequence (not a single bytes object) of non-empty `bytes` keys (`bytearray` and
  `memoryview` are copied to `bytes`), none longer than the smallest `max_key_bytes` of the
  hierarchy's backends and policies (a file tier's slot header holds
  `kvtier.tiers.file.backend.MAX_KEY_BYTES`, a compiled `lru` or `prefix-freq` index
  `kvtier.core.limits.MAX_KEY_BYTES`); with several KV groups each key names an existing group.
  `store` and `load` refuse duplicate keys.
- `engine_block_ids`: a sequence of ints (numpy integers too) or a 1-D integer array or tensor,
  `len(keys) * blocks_per_chunk` of them, each an engine block of the KV tensors (`0 <= id <
  num_engine_blocks`; no bools, floats or negative ids). `load` refuses an id given twice: one
  engine block cannot receive two keys.
- `kv_caches` (at `open`): torch tensors whose first dimension is the block, each block a
  contiguous run of at least `page_size_bytes` bytes; `blocks_per_chunk` an int >= 1.
A closed `KVTier` raises `ClosedError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from kvtier.config import HierarchyConfig, load_config
from kvtier.control.hierarchy import Hierarchy, build_hierarchy
from kvtier.control.hints import parse_hint
from kvtier.control.manager import SHUTDOWN_TIMEOUT_S
from kvtier.control.store_threshold import StoreThreshold
from kvtier.core.errors import ArgumentError, ClosedError
from kvtier.core.keys import OffloadKey
from kvtier.core.specs import LoadStoreSpec
from kvtier.core.types import CanonicalKVCaches, TransferResult
from kvtier.standalone.args import as_timeout, check_kv_caches, check_open_args
from kvtier.standalone.blocks import KeyBlocks
from kvtier.standalone.counters import TransferCounters
from kvtier.standalone.metrics import MetricsEndpoint, check_metrics_port
from kvtier.standalone.rounds import Rounds
from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches, KVLayout

_T = TypeVar("_T")
_RECHECK_S = 0.1  # how often a call waiting for a job looks whether another thread closed the KVTier
FLUSH_TIMEOUT_S = 60.0  # `close()`'s default bound on writing the first tier's dirty blocks down

log = logging.getLogger(__name__)


class KVTier:
    """A running hierarchy bound to one set of KV tensors.

    Thread-safe: one `KVTier` may be shared by several threads. `store`, `load`, `lookup`,
    `wait`, `flush` and `stats` never overlap: each runs whole while the others wait for it
    (the hierarchy's manager is single-threaded, as vLLM's scheduler drives it), and each waits
    only for its own jobs. `close()` may be called from any thread: calls waiting to run, and a
    call waiting for a copy, raise `ClosedError` (the copy itself finishes first).
    """

    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S  # `close`'s bound on finishing the jobs after its flush

    def __init__(self, hierarchy: Hierarchy, layout: KVLayout):
        self.hierarchy = hierarchy
        self.manager = hierarchy.manager
        self.layout = layout
        self.blocks_per_chunk = layout.blocks_per_chunk
        self._worker = hierarchy.worker  # the jobs that touch the KV tensors
        self._blocks = KeyBlocks(layout, hierarchy.key_limit())  # checks and lays out each call's keys and ids
        self._counters = TransferCounters()
        self._threshold: StoreThreshold[OffloadKey] = StoreThreshold(hierarchy.config.store_threshold)
        self._lock = threading.RLock()  # held by the running call (see the class docstring)
        self._closing = False  # set by `close()` before it takes the lock: waiting calls give up
        self._closed = False
        self._metrics: Any = None  # the metrics endpoint (`open(metrics_port=)`), stopped by `close`
        self._rounds = Rounds(self.manager, self._blocks, self._counters, self._wait_idle, self._run)

    @classmethod
    def open(cls, config: str | Path | HierarchyConfig, kv_caches: CanonicalKVCaches,
             blocks_per_chunk: int = 1, *, model: str = "", metrics_port: int | None = None,
             metrics_addr: str = "127.0.0.1", **build_options: Any) -> KVTier:
        """Build the hierarchy of `config` (a YAML path or a `HierarchyConfig`) around `kv_caches`.

        The block size in bytes is derived from the KV layout (see `kvtier.transfer.handlers.gpu_cpu`).
        `model` identifies the model whose KV this is, e.g. `"meta-llama/Llama-3.1-8B@<revision>"`:
        required when a tier keeps blocks across restarts (`file`) and its config sets no
        `fingerprint`. Such a tier records it with the layout of `kv_caches` (dtypes, shapes,
        pages, block geometry) and serves nothing written under another identity or layout.
        `metrics_port` (0: any free port, see `metrics_url`) serves `stats()` as Prometheus text
        at `http://{metrics_addr}:{port}/metrics` until `close()` (needs `prometheus_client`);
        `metrics_addr` is loopback by default (the endpoint has no authentication: give '0.0.0.0'
        or an interface's address only to let other hosts scrape it).
        `build_options` go to `build_hierarchy` (e.g. `enable_events=True`).
        """
        return _open(cls, config, kv_caches, blocks_per_chunk, model, metrics_port, metrics_addr, build_options)

    @property
    def metrics_url(self) -> str | None:
        """Where the metrics endpoint serves (`open(metrics_port=)`), None without one."""
        return None if self._metrics is None else self._metrics.url

    # ------------------------------------------------------------------ public API
    def store(self, keys: Sequence[bytes], engine_block_ids: Sequence[int],
              hints: Mapping[str, Any] | None = None) -> bool:
        """Copy the engine blocks of `keys` into the hierarchy. Keys already held are skipped.

        Stores in rounds no larger than what the first tier can take without losing a block:
        with a cascading first tier (`on_evict` or `on_store`), its free slots plus its blocks
        already copied below, waiting between rounds for the copies that make room; with cascade
        `none` (or one tier), its capacity (older blocks are evicted, as that mode means).
        Returns False when some blocks could not be stored (the hierarchy had no room: every
        block pinned or the next tier full; or a copy failed), logging a warning that says how
        many and why; the other rounds are stored all the same. With the config's
        `store_threshold` N (2 or more), each call counts as one offer of its keys, and a key
        not held is stored only from its Nth offer on (the others are counted in `stats()`'s
        `engine.stores_skipped`, and are not failures).

        `hints`: the session's retention hint for these blocks (`{"session": ..., "retain_s": ...,
        "priority": ..., "tenant": ..., "session_ended": ...}`; `kvtier.control.retention`)."""
        hint = parse_hint(hints, "hints")
        with self._call():
            keys = self._blocks.keys(keys, distinct=True)
            by_key = self._blocks.blocks_by_key(keys, engine_block_ids, distinct=False)
            pending = self.manager.stores.new_keys(keys)
            if self._threshold.enabled:  # each call is an offer of its keys (kvtier.control.store_threshold)
                admitted = set(self._threshold.admit(keys, set(pending)))
                self._counters.skip(len(pending) - len(admitted))
                pending = [key for key in pending if key in admitted]
            stored = self._rounds.store(pending, by_key)
            self.manager.retention.note(hint, keys, pending)
            return stored

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` can be loaded now: what `load` would find. Blocks found in a
        lower tier are brought up first when no handler loads them directly, as far as the first
        tier has room (this call waits for that); the rest of a longer run is counted where it is
        (`load` brings it up in rounds)."""
        with self._call():
            return self._rounds.loadable(self._blocks.keys(keys, distinct=False))

    def load(self, keys: Sequence[bytes], engine_block_ids: Sequence[int],
             hints: Mapping[str, Any] | None = None) -> int:
        """Load the longest loadable prefix of `keys` into its engine blocks; returns how many keys
        were loaded (the first n). Blocks a lower tier supplies through the first tier come up
        in rounds of what the first tier has room for, so the whole prefix is loaded however
        long. A block whose copy fails (a read that does not verify, an I/O error) ends the
        prefix: it is dropped from its tier (a MISS from then on, counted in its `failures`), the
        others stay; the caller recomputes from it. Tiers' `hits` count the prefix returned only.
        The blocks loaded count as used (`touch`, head to tail, as vLLM touches a request's hits):
        each tier's policy sees the reuse (recency, frequency). `hints`: as `store`'s, for the
        blocks loaded."""
        hint = parse_hint(hints, "hints")
        with self._call():
            keys = self._blocks.keys(keys, distinct=True)
            loaded = self._rounds.load(keys, self._blocks.blocks_by_key(keys, engine_block_ids, distinct=True))
            if loaded:
                self.manager.touch(keys[:loaded])
            self.manager.retention.note(hint, keys[:loaded])
            return loaded

    def wait(self) -> None:
        """Block until every background job (cascades, promotions) has finished."""
        with self._call():
            self._wait_idle()
            self._worker.wait()

    def flush(self, timeout: float | None = None) -> int:
        """Write every block that is not yet in the next tier down (the first tier's dirty blocks
        under cascade `on_evict`; under `on_store` those whose copy is still queued or failed),
        and wait for the copies, at most `timeout` seconds (None: no limit). Returns how many
        blocks are still without a copy below (0: a restart finds every block a lower,
        persistent tier can hold). `ClosedError` when another thread closes the KVTier meanwhile."""
        timeout = as_timeout(timeout, "timeout")
        with self._call():
            return self.manager.flush(timeout, check=self._check_open)  # ClosedError once another thread closes

    def stats(self) -> dict[str, Any]:
        """Per-tier counters of the manager plus this API's store/load totals under `"engine"`
        (with `"retention"`, the sessions' hints, once a hint was given)."""
        with self._lock:
            engine: dict[str, Any] = self._counters.as_dict()
            retention = self.manager.retention
            if retention.stats.hints or retention.stats.hints_refused:
                engine["retention"] = retention.report()
            return {**self.manager.get_stats(), "engine": engine}

    def close(self, flush: bool = True, flush_timeout: float | None = FLUSH_TIMEOUT_S) -> None:
        """Write the dirty blocks down (`flush`, unless `flush` is False; at most `flush_timeout`
        seconds, logging how many were not written), finish background jobs and release every
        tier, at most `shutdown_timeout` seconds more (copies still running then, a read or
        write hung in the kernel, are abandoned and logged: `Hierarchy.close`). Idempotent; from
        any thread: the other threads' calls end with `ClosedError`."""
        flush_timeout = as_timeout(flush_timeout, "flush_timeout")
        self._closing = True
        if self._metrics is not None:  # (first: a scrape waits for the lock held below)
            self._metrics.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if flush:
                    left = self.manager.flush(flush_timeout)
                    if left:
                        log.warning("close: %d block(s) were not written to the next tier within %s s and are "
                                    "lost with this process (call flush() first, or raise flush_timeout)",
                                    left, flush_timeout)
            finally:
                self.hierarchy.close(self.shutdown_timeout)

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _call(self) -> Iterator[None]:
        """Run one public call alone (the class docstring); `ClosedError` once closing."""
        self._check_open()
        with self._lock:
            self._check_open()
            yield

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise ClosedError("KVTier is closed: open a new one with KVTier.open")

    def _wait_idle(self) -> None:
        """`manager.wait_idle`, giving up with `ClosedError` when another thread closes the KVTier."""
        self._patiently(self.manager.wait_idle)

    def _run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferResult:
        """Submit one job to the worker plane and wait for its result (`ClosedError` when another
        thread closes the KVTier meanwhile: the job finishes before the close releases a tier)."""
        job_id = self._worker.submit(src, dst)
        return self._patiently(lambda timeout: self._worker.result(job_id, timeout=timeout))

    def _patiently(self, wait: Callable[[float], _T]) -> _T:
        """`wait(_RECHECK_S)` until it returns without `TimeoutError`, checking in between that
        no other thread closed the KVTier (`ClosedError`)."""
        while True:
            try:
                return wait(_RECHECK_S)
            except TimeoutError:  # (WaitTimeout is one)
                self._check_open()


def _open(cls: type[KVTier], config: str | Path | HierarchyConfig, kv_caches: CanonicalKVCaches,
          blocks_per_chunk: int, model: str, metrics_port: int | None, metrics_addr: str,
          build_options: dict[str, Any]) -> KVTier:
    """`KVTier.open`'s work: check the arguments, build the hierarchy, and close it again if the
    `KVTier` around it cannot be made."""
    check_open_args(config, model, build_options)
    check_kv_caches(kv_caches, blocks_per_chunk)
    check_metrics_port(metrics_port, metrics_addr)
    if not isinstance(config, HierarchyConfig):
        config = load_config(config)
    chunked = ChunkedKVCaches(list(kv_caches.tensors), list(kv_caches.group_data_refs), blocks_per_chunk)
    layout = KVLayout(chunked, blocks_per_chunk)
    if config.shared is not None:
        from kvtier.standalone.shared import open_shared

        if metrics_port is not None or build_options:
            raise ArgumentError(f"{'metrics_port' if metrics_port is not None else next(iter(build_options))}: "
                                "not with 'shared: host': the tiers are the host owner's (kvtier serve); "
                                "stats() reports them")
        return open_shared(config, chunked, layout, model)  # type: ignore[return-value]
    hierarchy = build_hierarchy(config, block_bytes=layout.block_bytes, kv_caches=chunked, model=model,
                                **build_options)
    try:
        tier = cls(hierarchy, layout)
        if metrics_port is not None:
            tier._metrics = MetricsEndpoint(tier.stats, metrics_port, metrics_addr)
        return tier
    except BaseException:
        hierarchy.close()
        raise
