"""One hierarchy of the host owner: the tiers every engine of one model identity shares.

Engines of the same identity (`Identity`: the model as the engine names it, with its KV layout,
block bytes and block tokens) share one namespace; engines of another identity get another
namespace, with its own CPU region and its own directory under each file tier's `root_dir`
(`host-<namespace>`), so they never see each other's blocks. The first engine's YAML decides the
namespace's tiers; a later engine of the same identity whose YAML describes other tiers is refused,
naming the difference.

The namespace's `HierarchyManager` is the one writer of its block state: every call runs under
`lock`, from any connection. What each connection holds (the loads it pinned, the stores it has
not completed) is in its `Ledger`; when the connection goes, `expire` releases what is left after
`lease_grace_s` (an engine's worker may still be copying into or out of those slots), never before.
A request the engine gave up waiting for (its `timeout_ms`) is followed by a `cancel` of it: the
slots its `prepare_store` reserved and the pins its `prepare_load` took are released at once (the
engine never copies into or out of them), since a connection's requests are answered in order.
A namespace no engine has used for a while (`idle_s`) can be closed by the owner like at its stop.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import HierarchyConfig, parse_config
from kvtier.config.input import plain
from kvtier.control.hints import HINTS_KEY, parse_hint
from kvtier.control.store_threshold import StoreThreshold
from kvtier.core.errors import ConfigError
from kvtier.core.keys import OffloadKey
from kvtier.core.limits import MAX_KEY_BYTES
from kvtier.core.specs import CPULoadStoreSpec
from kvtier.core.types import LookupResult, ReqContext
from kvtier.host.wire import hex_keys, parse_keys

log = logging.getLogger(__name__)

LEASE_GRACE_S = 30.0  # how long the slots of a departed connection stay as they were
BUSY_S = 1.0  # a namespace called within this long is stepped every heartbeat


@dataclass(frozen=True)
class Identity:
    """What makes two engines' blocks interchangeable."""

    model: str  # vLLM: the spec's fingerprint (model, dtype, layout, ranks); standalone: model and layout
    block_bytes: int
    block_tokens: int

    @classmethod
    def parse(cls, raw: Any) -> Identity:
        if not isinstance(raw, dict):
            raise ValueError("identity: expected a mapping {model, block_bytes, block_tokens}")
        model, block_bytes, block_tokens = raw.get("model"), raw.get("block_bytes", 0), raw.get("block_tokens", 0)
        if not isinstance(model, str) or not model:
            raise ValueError(f"identity.model: expected a non-empty string, got {model!r}")
        for name, value in (("block_bytes", block_bytes), ("block_tokens", block_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"identity.{name}: expected a positive integer, got {value!r}")
        return cls(model, block_bytes, block_tokens)

    def name(self) -> str:
        """The namespace's name: a digest of the identity (16 hex digits)."""
        text = json.dumps([self.model, self.block_bytes, self.block_tokens])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:40]


def namespace_config(raw: Any, identity: Identity, name: str) -> HierarchyConfig:
    """The hierarchy an engine's YAML (`raw`, a mapping) asks for, as the owner builds it: without
    `shared`, with the engine's block tokens, each `cpu` tier in the region `kvtier-host-<name>-<tier>`
    (unpinned: the owner never touches a GPU) and each `file` tier under `<root_dir>/host-<name>`."""
    raw = plain(raw, "the engine's config")
    if not isinstance(raw, dict):
        raise ConfigError([("", "the engine's config must be a mapping with a 'tiers' list")])
    raw.pop("shared", None)
    raw.pop("block_bytes", None)
    raw["block_tokens"] = identity.block_tokens
    for tier in raw.get("tiers") or []:
        if not isinstance(tier, dict):
            continue
        if tier.get("backend") == "cpu":
            tier["shm_name"] = f"kvtier-host-{name}-{_safe(str(tier.get('name')))}"
            tier["pin"] = False
        elif tier.get("backend") == "file" and isinstance(tier.get("root_dir"), str):
            tier["root_dir"] = os.path.join(tier["root_dir"], f"host-{name}")
    config = parse_config(raw, f"the host namespace {name}")
    if config.tiers[0].backend != "cpu":
        raise ConfigError([("tiers[0].backend", f"a shared hierarchy starts with a 'cpu' tier (the region every "
                                                f"engine maps), got {config.tiers[0].backend!r}")])
    return config


def hinted(message: dict[str, Any]) -> ReqContext | None:
    """The call's retention hint (`hints`; `ValueError` naming the field when invalid) as the
    request the owner's manager is given, so that it notes the hint as the engine's own
    hierarchy would (`HierarchyManager`: the session's blocks, and its first victims once it
    ended, which a call without the hint takes as used again); None without one. `request`: the
    engine's request id (a vLLM engine sends it: a request's calls end its session once);
    without one, the call is a request of its own (the standalone API's calls)."""
    hints = message.get("hints")
    if parse_hint(hints, "hints") is None:
        return None
    request = message.get("request")
    if request is None:
        request = f"call {next(_CALLS)}"
    elif not isinstance(request, str) or len(request) > MAX_REQUEST_ID:
        raise ValueError(f"request: expected a request id (a string of at most {MAX_REQUEST_ID} characters)")
    return ReqContext(request, kv_transfer_params={HINTS_KEY: hints})


MAX_REQUEST_ID = 512  # characters of an engine's request id (vLLM's are about 40)
_CALLS = itertools.count()  # (ids of the calls that name no request)


@dataclass
class Ledger:
    """What one connection holds in its namespace: load pins (a count per key, one per
    `prepare_load`) and the stores it has not completed."""

    loads: Counter[OffloadKey] = field(default_factory=Counter)
    stores: set[OffloadKey] = field(default_factory=set)
    # The last request's id, the keys it pinned and those it gave to store: what a `cancel` of it undoes.
    last: tuple[Any, list[OffloadKey], list[OffloadKey]] = (None, [], [])


class Namespace:
    """A hierarchy shared by the engines of one identity (the module docstring)."""

    def __init__(self, identity: Identity, raw_config: Any, *, lease_grace_s: float = LEASE_GRACE_S):
        from kvtier.control.hierarchy import build_hierarchy

        self.identity = identity
        self.name = identity.name()
        self.config = namespace_config(raw_config, identity, self.name)
        self._shape = _shape(self.config)
        self.hierarchy = build_hierarchy(self.config, block_bytes=identity.block_bytes, model=identity.model)
        self.manager = self.hierarchy.manager
        self.threshold: StoreThreshold[OffloadKey] = StoreThreshold(self.config.store_threshold)  # (host-wide)
        self.lock = threading.Lock()
        self.lease_grace_s = lease_grace_s
        self._expiring: list[tuple[float, Ledger]] = []
        self._last_call = time.monotonic()  # (a namespace is stepped often while engines use it: `step`)
        self.engines = 0  # connections that said hello to it and are still open (the owner's lock guards it)
        region: Any = self.hierarchy.first_backend  # (a CPUBackend: namespace_config)
        self.region = {"shm_name": region.shm_name, "num_blocks": region.num_blocks,
                       "block_bytes": region.block_bytes, "token": region.token}
        self.tier = self.config.tiers[0].name
        limit, _ = self.hierarchy.key_limit()
        self.max_key_bytes = MAX_KEY_BYTES if limit == float("inf") else int(limit)  # (bounded even when no tier says)

    def check_same(self, raw_config: Any) -> None:
        """`ConfigError` unless `raw_config` asks for this namespace's tiers (`_shape`), naming the
        first setting that differs and both values."""
        held, asked = self._shape, _shape(namespace_config(raw_config, self.identity, self.name))
        for path in [*held, *(path for path in asked if path not in held)]:
            mine, other = held.get(path, "(not set)"), asked.get(path, "(not set)")
            if mine != other:
                raise ConfigError([(path, f"the host namespace {self.name} of this model already has {path}="
                                          f"{mine!r}; this engine asks for {path}={other!r}: give every engine "
                                          f"of one model on the host the same tiers")])

    # ------------------------------------------------------------------ calls
    def call(self, op: str, message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """Answer one request of a connection whose holdings are `ledger`; `ValueError` on a bad one."""
        handler = _OPS.get(op)
        if handler is None and op != "cancel":
            raise ValueError(f"op: unknown operation {op!r}")
        keys = parse_keys(message.get("keys", []))
        bad = next((i for i, key in enumerate(keys) if not 0 < len(key) <= self.max_key_bytes), None)
        if bad is not None:
            raise ValueError(f"keys[{bad}]: {len(keys[bad])} bytes; a key has 1 to {self.max_key_bytes} bytes here")
        with self.lock:
            self._last_call = time.monotonic()
            last, ledger.last = ledger.last, (message.get("id"), [], [])
            if handler is None:
                return self._cancel(last, message, ledger)
            return handler(self, keys, message, ledger)

    def _cancel(self, last: tuple[Any, list[OffloadKey], list[OffloadKey]], message: dict[str, Any],
                ledger: Ledger) -> dict[str, Any]:
        """The engine gave up waiting for request `of` (its deadline passed): when it is the last one
        answered (`last`), release the pins it took and fail the stores it reserved (the module
        docstring). `cancelled`: how many."""
        ident, pinned, stored = last
        if ident is None or message.get("of") != ident:
            return {"cancelled": 0}
        released = self._complete_load(pinned, {}, ledger)["released"]
        completed = self._complete_store(stored, {"success": False}, ledger)["completed"]
        if released or completed:
            log.debug("kvtier host: namespace %s: a cancelled request's %d pin(s) and %d store(s) released",
                      self.name, released, completed)
        return {"cancelled": released + completed}

    def _lookup_run(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """Leading HITs and the first other answer; `held`: how far the run goes counting the blocks a
        lower tier holds (what a load gets once they are promoted)."""
        hits, then = self.manager.lookup_run(keys)
        held, source = hits, self.manager.load_source
        while held < len(keys) and source(keys[held]) is not None:
            held += 1
        if then is LookupResult.RETRY:  # promote the rest of the run too, as vLLM's scan past a RETRY would
            for key in keys[hits + 1:held]:
                self.manager.lookup(key)
        if held > hits:
            self._make_room(held - hits)  # (for the promotions: a full tier of dirty blocks refuses them)
        return {"hits": hits, "next": None if then is None else then.name, "held": held}

    def _prepare_load(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """Pin the leading run of `keys` readable in the first tier now (another engine may have
        evicted one since this engine's lookup): their slots, and how many."""
        call = hinted(message)
        readable, _ = self.manager.lookup_run(keys)
        if not readable:
            return {"slots": []}
        spec = self.manager.prepare_load(keys[:readable], call)  # (a hit of the session's blocks: `hinted`)
        if not isinstance(spec, CPULoadStoreSpec):  # (the owner promotes every lower tier's hit first)
            self.manager.complete_load(keys[:readable])
            return {"slots": []}
        ledger.loads.update(keys[:readable])
        ledger.last = (message.get("id"), keys[:readable], [])
        return {"slots": spec.block_ids, "token": self.region["token"]}

    def _complete_load(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        failed = set(parse_keys(message.get("failed", []), "failed"))
        held = []  # one pin per key named, as many as this connection holds (a key may be named twice)
        for key in keys:
            if ledger.loads[key] > 0:
                ledger.loads[key] -= 1
                held.append(key)
        ledger.loads += Counter()  # (drops the keys at 0)
        self.manager.complete_load(held, failed=[key for key in held if key in failed])
        return {"released": len(held)}

    def _touch(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """The blocks a request used count as used, with its retention hint (`hinted`): a hit of
        a session's blocks starts its retention again, an ended session's blocks stay its first
        victims (without a hint, a touch makes them ordinary blocks again: used again)."""
        self.manager.touch(keys, hinted(message))
        return {}

    def _prepare_store(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """Slots for the keys not held yet, less those the store threshold skips (`skipped`: how
        many). Each call is one offer of its keys (as each vLLM `prepare_store` is), counted
        host-wide, unless it says `"offer": false` (the same offer asked again after no room).
        `reused`: the offer's keys readable in the first tier (a vLLM engine touches them when
        the request finishes, as a private hierarchy's adapter does)."""
        call = hinted(message)
        readable = self.manager.tiers[0].readable
        offer, skipped, reused = keys, 0, hex_keys([key for key in keys if readable(key) is not None])
        if self.threshold.enabled:
            absent = set(self.manager.stores.new_keys(keys))
            counted = message.get("offer", True) is not False
            keys = self.threshold.admit(keys, absent) if counted else self.threshold.passes(keys, absent)
            skipped = len(offer) - len(keys) if counted else 0
        out = self.manager.prepare_store(keys, call)  # (with the session's retention hint: `hinted`)
        if out is None:
            self._make_room(len(keys))  # (the engine asks again once the copies down are made)
            return {"room": False, "skipped": skipped, "reused": reused}
        store = list(out.keys_to_store)
        ledger.stores.update(store)
        ledger.last = (message.get("id"), [], store)
        assert isinstance(out.store_spec, CPULoadStoreSpec)  # (the first tier is a cpu tier: namespace_config)
        return {"room": True, "store": hex_keys(store), "slots": out.store_spec.block_ids,
                "token": self.region["token"], "evicted": hex_keys(out.evicted_keys), "skipped": skipped,
                "reused": reused}

    def _make_room(self, count: int) -> None:
        """Start copying down the first tier's next victims that are not below yet, so that `count`
        blocks (at most its capacity) fit without dropping one (`StorePath.room`)."""
        stores, capacity = self.manager.stores, self.manager.tiers[0].capacity
        room = stores.room()
        if room is not None and room < min(count, capacity):
            stores.clean_ahead(min(count, capacity) - room)

    def _complete_store(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        held = [key for key in keys if key in ledger.stores]
        ledger.stores.difference_update(held)
        self.manager.complete_store(held, success=message.get("success") is True)
        return {"completed": len(held)}

    def _stats(self, keys: list[OffloadKey], message: dict[str, Any], ledger: Ledger) -> dict[str, Any]:
        """Per-tier counters and the sessions' retention (`Retention.report()`), every engine's."""
        return {"tiers": self.manager.get_stats(), "retention": self.manager.retention.report(), "namespace": self.name}

    # ------------------------------------------------------------------ background
    def expire(self, ledger: Ledger) -> None:
        """The connection holding `ledger` is gone: release what it holds after the grace period."""
        if ledger.loads or ledger.stores:
            with self.lock:
                self._expiring.append((time.monotonic() + self.lease_grace_s, ledger))

    def step(self) -> bool:
        """The owner's heartbeat: account finished copies, start promotions and cascade copies
        (`on_schedule_end`, as vLLM's scheduler calls it each step), and release expired ledgers.
        Returns whether the namespace is busy: a call came within `BUSY_S`, copies are in flight,
        or a departed engine's ledger waits (else the owner may step it less often)."""
        with self.lock:
            now = time.monotonic()
            due = [ledger for at, ledger in self._expiring if at <= now]
            if due:
                self._expiring = [(at, ledger) for at, ledger in self._expiring if at > now]
            for ledger in due:
                self._release(ledger)
            busy = now - self._last_call < BUSY_S or self.manager.has_pending_work()
            if busy:
                self.manager.on_schedule_end()
            return busy or bool(self._expiring)

    def idle_s(self) -> float:
        """Seconds since an engine last used this namespace; 0 while one is connected, a departed
        one's ledger waits or copies are in flight (the owner's lock held: `engines`)."""
        if self.engines:
            return 0.0
        with self.lock:
            if self._expiring or self.manager.has_pending_work():
                return 0.0
            return time.monotonic() - self._last_call

    def leave(self) -> None:
        """One of its engines' connections closed (the owner's lock held)."""
        self.engines -= 1
        self._last_call = time.monotonic()  # (idle from now)

    def _release(self, ledger: Ledger) -> None:
        if ledger.loads:
            self.manager.complete_load(list(ledger.loads.elements()))
        if ledger.stores:
            self.manager.complete_store(list(ledger.stores), success=False)
        log.info("kvtier host: namespace %s released %d pin(s) and %d unfinished store(s) of a departed engine",
                 self.name, sum(ledger.loads.values()), len(ledger.stores))
        ledger.loads.clear()
        ledger.stores.clear()

    def close(self, flush_timeout: float) -> int:
        """Write the first tier's dirty blocks down (at most `flush_timeout` s) and close the tiers;
        returns how many blocks were left without a copy below."""
        with self.lock:
            try:
                return self.manager.flush(flush_timeout)
            finally:
                self.hierarchy.close()


def _shape(config: HierarchyConfig) -> dict[str, Any]:
    """What two engines' YAMLs must agree on, setting by setting (`tiers[1].root_dir`): the number
    of tiers, every field and option of each tier as the owner parses them (what a tier holds,
    where, how it evicts and cascades: none may differ, since the owner serves every engine with
    the first one's tiers), and the store threshold."""
    shape: dict[str, Any] = {"tiers": len(config.tiers)}
    for i, tier in enumerate(config.tiers):
        fields = {"name": tier.name, "backend": tier.backend, "capacity": str(tier.capacity), "policy": tier.policy,
                  "cascade": tier.cascade, "reserve": tier.reserve}
        fields.update(sorted((str(k), v) for k, v in tier.options.items()))
        shape.update((f"tiers[{i}].{name}", value) for name, value in fields.items())
    shape["store_threshold"] = config.store_threshold if config.store_threshold >= 2 else 0
    return shape


_OPS = {"lookup_run": Namespace._lookup_run, "prepare_load": Namespace._prepare_load,
        "complete_load": Namespace._complete_load, "touch": Namespace._touch,
        "prepare_store": Namespace._prepare_store, "complete_store": Namespace._complete_store,
        "stats": Namespace._stats}
