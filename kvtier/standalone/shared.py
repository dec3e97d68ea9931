"""`SharedKVTier`: the standalone API over the host's shared hierarchy (`shared: host` in the YAML).

`KVTier.open` returns one when the config says `shared: host`: the tiers are the host owner's
(`kvtier serve`, `kvtier.host`), shared with every engine of the same model identity on the host.
This process maps the owner's CPU region and copies its blocks in and out of it itself; only keys
and slot numbers go through the owner's socket. Same calls and argument checks as `KVTier`.

Failure is a miss: when the owner does not answer within `timeout_ms` (not running, hung,
restarting), `lookup` and `load` answer 0 more blocks and `store` returns False; nothing waits
longer than that per call. A block is copied out of the region only while the owner holds it
pinned for this engine, and a stored block becomes readable only once its copy succeeded.
`flush` has nothing to write: the owner keeps the blocks and outlives this engine (it writes its
CPU tier down when it stops).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.config import HierarchyConfig
from kvtier.config.shared import config_mapping
from kvtier.control.hints import parse_hint
from kvtier.core.errors import ArgumentError, ClosedError
from kvtier.core.keys import OffloadKey
from kvtier.core.limits import MAX_KEY_BYTES
from kvtier.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvtier.core.types import TransferResult
from kvtier.host.client import HostClient, join
from kvtier.host.region import RegionMap
from kvtier.host.wire import HostUnavailable, hex_keys, hint_fields, parse_keys
from kvtier.standalone.blocks import KeyBlocks
from kvtier.standalone.counters import TransferCounters
from kvtier.tiers.cpu import RegionError
from kvtier.transfer.handlers.gpu_cpu import KVLayout

log = logging.getLogger(__name__)

ROUND_BLOCKS = 256  # keys per store or load round: one owner call each way
MAX_STALLED_ROUNDS = 3  # lookups that found blocks another engine evicted before they could be pinned
# How long a lookup asks again for blocks held below whose promotion the owner refused for want of
# room, while the readable run does not grow: longer than the owner keeps just-promoted blocks from
# other promotions' evictions (`kvtier.control.promotion.HOLD_S`).
REFUSED_WAIT_S = 2.5
PATIENCE_S = 5.0  # the longest a call waits for the owner's promotions or room
RETRY_WAIT_S = 0.001  # how often a call asks again while the owner promotes blocks or makes room


class SharedKVTier:
    """The standalone API on the host's shared hierarchy (the module docstring)."""

    def __init__(self, config: HierarchyConfig, client: HostClient, layout: KVLayout, kv_caches: Any):
        self.config = config
        self.client = client
        self.layout = layout
        self.blocks_per_chunk = layout.blocks_per_chunk
        self._regions = RegionMap(kv_caches)
        self._blocks = KeyBlocks(layout, (MAX_KEY_BYTES, "the host owner's index"))
        self._counters = TransferCounters()
        self._lock = threading.RLock()
        self._closed = False
        self._hints = 0  # calls that carried a hint (`stats()["engine"]["retention"]["hints"]`)
        self._requests = f"standalone {uuid.uuid4().hex[:12]}"  # (this engine's calls' ids: `_hinted`)
        self._request_numbers = itertools.count()

    # ------------------------------------------------------------------ public API
    def store(self, keys: Sequence[bytes], engine_block_ids: Sequence[int],
              hints: Mapping[str, Any] | None = None) -> bool:
        """Copy the engine blocks of `keys` into the shared hierarchy (keys it holds are skipped).
        False when some could not be stored: no room, a failed copy, or the owner unavailable.
        `hints`: the session's retention hint, as `KVTier.store`'s (the owner keeps the session's
        blocks for every engine of the host)."""
        hinted = self._hinted(hints)  # (refused here, naming the field, before the owner is asked)
        with self._call():
            keys = self._blocks.keys(keys, distinct=True)
            by_key = self._blocks.blocks_by_key(keys, engine_block_ids, distinct=False)
            size = self._round_blocks()
            self._hints += hinted["hints"] is not None
            return all([self._store_round(keys[i:i + size], by_key, hinted) for i in range(0, len(keys), size)])

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the shared hierarchy can load now (0 when the owner is unavailable)."""
        with self._call():
            return self._hits(self._blocks.keys(keys, distinct=False), held=True)

    def load(self, keys: Sequence[bytes], engine_block_ids: Sequence[int],
             hints: Mapping[str, Any] | None = None) -> int:
        """Load the longest loadable prefix of `keys` into its engine blocks; how many were loaded.
        `hints`: as `store`'s, for the blocks loaded."""
        hinted = self._hinted(hints)
        with self._call():
            self._hints += hinted["hints"] is not None
            keys = self._blocks.keys(keys, distinct=True)
            by_key = self._blocks.blocks_by_key(keys, engine_block_ids, distinct=True)
            loaded, stalled, size = 0, 0, self._round_blocks()
            while loaded < len(keys) and stalled < MAX_STALLED_ROUNDS:
                window = keys[loaded:loaded + size]  # (what the owner's first tier can take beside other engines')
                pinned, good = self._load_round(window, by_key, hinted)
                loaded += good
                if good < pinned or (pinned == 0 and not self._hits(window)):
                    break  # a failed copy, or nothing more to find (after waiting for promotions)
                stalled = stalled + 1 if pinned == 0 else 0  # (found, then evicted by another engine again)
            if loaded:
                self._touch(keys[:loaded], hinted)
            return loaded

    def _hinted(self, hints: Mapping[str, Any] | None) -> dict[str, Any]:
        """The fields every owner call of one `store` or `load` carries: `hints` checked as
        `KVTier`'s are (`ArgumentError` naming the field) and sent as a plain dict, whatever
        mapping it came in; with a hint, the call's own `request` id, so that the owner takes its
        rounds and touch as one request (a session they end is counted ended once)."""
        hint = hint_fields(parse_hint(hints, "hints"))
        if hint is None:
            return {"hints": None}
        return {"hints": hint, "request": f"{self._requests} {next(self._request_numbers)}"}

    def _touch(self, keys: list[OffloadKey], hinted: dict[str, Any]) -> None:
        """The blocks loaded count as used in the owner's tiers (`KVTier.load`), with the call's
        hint (an ended session's blocks stay its first victims); an owner that does not answer
        misses that reuse only."""
        try:
            self.client.call("touch", keys=hex_keys(keys), **hinted)
        except HostUnavailable:
            pass

    def wait(self) -> None:
        """Every call returns when its copies are done: nothing to wait for."""
        with self._call():
            return

    def flush(self, timeout: float | None = None) -> int:
        """Nothing of this engine's is unwritten: the owner holds the blocks (module docstring)."""
        with self._call():
            return 0

    def stats(self) -> dict[str, Any]:
        """The owner's per-tier counters (empty when it does not answer) and this engine's totals,
        with `"retention"` once a hint was given (as `KVTier.stats()`'s): `hints` counts this
        engine's calls that carried one, the other numbers are the owner's (every engine's)."""
        with self._lock:
            try:
                answer = self.client.call("stats")
            except HostUnavailable:
                answer = {}
            engine: dict[str, Any] = {**self._counters.as_dict(), "host_failures": self.client.failures}
            retention = answer.get("retention") or {}
            if retention.get("hints") or retention.get("hints_refused") or self._hints:
                engine["retention"] = {**retention, "hints": self._hints, "hints_refused": 0}
            return {**answer.get("tiers", {}), "engine": engine}

    def close(self, flush: bool = True, flush_timeout: float | None = None) -> None:
        """Leave the shared hierarchy (the owner keeps the blocks) and unmap the region. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.client.close()
            self._regions.close()

    def __enter__(self) -> SharedKVTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ rounds
    def _call(self) -> Any:
        if self._closed:
            raise ClosedError("KVTier is closed: open a new one with KVTier.open")
        return self._lock

    def _round_blocks(self) -> int:
        """Keys per round: a quarter of the owner's first tier at most (other engines use it too)."""
        region = self.client.region
        return max(1, min(ROUND_BLOCKS, (region["num_blocks"] if region else ROUND_BLOCKS) // 4))

    def _patience(self) -> float:
        """When a call stops waiting for the owner's copies (promotions, copies down that make room)."""
        return time.monotonic() + PATIENCE_S

    def _hits(self, keys: list[OffloadKey], held: bool = False) -> int:
        """Leading keys readable in the owner's first tier, waiting while it promotes blocks from
        below (RETRY, HIT_PENDING; for a load, a promotion it refused for want of room is asked
        again for up to `REFUSED_WAIT_S` after the run of readable blocks last grew); `held`
        (a lookup): counting on from there the blocks a lower tier holds, without waiting for
        refused promotions (`load` brings those blocks up in rounds: the count is the same)."""
        deadline, best, progress = self._patience(), -1, time.monotonic()
        while keys:
            try:
                answer = self.client.call("lookup_run", keys=hex_keys(keys))
            except HostUnavailable:
                return 0
            hits, now = int(answer["hits"]), time.monotonic()
            if hits > best:
                best, progress = hits, now
            waiting = answer["next"] in ("RETRY", "HIT_PENDING") or (
                not held and answer["held"] > hits and now - progress < REFUSED_WAIT_S)
            if not waiting or now >= deadline:
                return int(answer["held"]) if held else hits
            time.sleep(RETRY_WAIT_S)
        return 0

    def _store_round(self, keys: list[OffloadKey], by_key: dict[OffloadKey, list[int]],
                     hinted: dict[str, Any]) -> bool:
        deadline, offer = self._patience(), True
        while True:
            try:  # (asked again, the same offer is not counted again by the owner's store threshold)
                answer = self.client.call("prepare_store", keys=hex_keys(keys), offer=offer, **hinted)
            except HostUnavailable as exc:
                log.warning("store: %d block(s) not stored: %s", len(keys), exc)
                return False
            self._counters.skip(int(answer.get("skipped", 0)))
            if answer["room"] or time.monotonic() >= deadline:
                break
            offer = False
            time.sleep(RETRY_WAIT_S)  # (the owner copies blocks down to make room)
        if not answer["room"]:
            log.warning("store: %d block(s) not stored: the shared tier has no room for them", len(keys))
            return False
        to_store = parse_keys(answer["store"])
        if not to_store:
            return True
        result = self._copy(to_store, answer["slots"], answer["token"], by_key, into_region=True)
        try:
            self.client.call("complete_store", keys=hex_keys(to_store), success=result.success)
        except HostUnavailable:
            return False  # (the owner drops the unfinished stores of a connection it lost)
        self._counters.count("store", result, len(to_store))
        return result.success

    def _load_round(self, window: list[OffloadKey], by_key: dict[OffloadKey, list[int]],
                    hinted: dict[str, Any]) -> tuple[int, int]:
        """Load the leading run of `window` readable in the owner's first tier now (pinned for this
        engine meanwhile): (how many were pinned, how many leading ones were loaded). A block whose
        copy failed is reported to the owner, which drops it."""
        try:
            answer = self.client.call("prepare_load", keys=hex_keys(window), **hinted)
        except HostUnavailable:
            return 0, 0
        slots = answer["slots"]
        pinned = window[:len(slots)]
        if not pinned:
            return 0, 0
        result = TransferResult(0, False)
        try:
            result = self._copy(pinned, slots, answer["token"], by_key, into_region=False)
        finally:
            positions = result.failed_positions(len(pinned))
            # (not waited for: the owner releases the pins of a connection it lost anyway)
            self.client.notify("complete_load", keys=hex_keys(pinned), failed=hex_keys(pinned[p] for p in positions))
        loaded = min(positions, default=len(pinned))
        self._counters.count("load", result, loaded)
        return len(pinned), loaded

    def _copy(self, keys: list[OffloadKey], slots: list[int], token: str, by_key: dict[OffloadKey, list[int]],
              into_region: bool) -> TransferResult:
        """Copy `keys` between their engine blocks and their `slots` of the owner's region, the one
        whose token the owner's answer names (else the copy fails: no other region's slots are used)."""
        region = self.client.region
        if region is None or region["token"] != token:
            return TransferResult(0, False, error="the owner answered for another region than the one mapped")
        try:
            plane = self._regions.plane(region, self.client.tier)
        except (RegionError, OSError) as exc:  # (the owner restarted since its hello: its region is gone)
            return TransferResult(0, False, error=f"cannot map the owner's region: {exc}")
        order = self._blocks.group_order(keys)
        gpu: GPULoadStoreSpec = self._blocks.gpu_spec([keys[i] for i in order], by_key)
        cpu = CPULoadStoreSpec([slots[i] for i in order], tier=self.client.tier)
        job = plane.submit(cpu, gpu) if not into_region else plane.submit(gpu, cpu)
        result = plane.result(job)
        if result.success or not result.failed_blocks:
            return result
        # (positions of the job are in group order: give them back in the caller's order)
        return TransferResult(result.job_id, False, result.transfer_size, result.transfer_time,
                              failed_blocks=tuple(order[p] for p in result.failed_blocks), error=result.error)


def open_shared(config: HierarchyConfig, kv_caches: Any, layout: KVLayout, model: str) -> SharedKVTier:
    """`KVTier.open` for a `shared: host` config: join the owner's hierarchy for this model and
    KV layout. `ArgumentError` without `model` (engines of one model share blocks, so the owner
    must know which); `HostRefused` when the owner refuses this YAML (another engine of the same
    model runs other tiers). An owner not running now is not an error: calls are misses until it is."""
    from kvtier.control.hierarchy import describe_layout

    if not isinstance(model, str) or not model:
        raise ArgumentError("model: required with shared: host (engines of one model share the host's blocks; "
                            "pass model='<model name>@<revision>')")
    identity = {"model": f"standalone:{model} | {describe_layout(layout.block_bytes, config.block_tokens, kv_caches)}",
                "block_bytes": layout.block_bytes, "block_tokens": config.block_tokens}
    assert config.shared is not None  # (KVTier.open calls this for a shared config only)
    return SharedKVTier(config, join(config.shared, identity, config_mapping(config)), layout, kv_caches)
