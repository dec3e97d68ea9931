"""A fake `RemoteStore` (the `kvtier.tiers.remote.store` contract) over a dict, with failure injection.

`FakeServer` plays one Valkey/Redis server that several stores (several "engines") share;
`server.store` is a `ValkeyBackend.store_factory`::

    server = FakeServer()
    monkeypatch.setattr(ValkeyBackend, "store_factory", server.store)

Values are kept under (prefix, identity, key) so that another tenant, model or layout never sees
them, as the real key scheme guarantees. Injected failures:
- `server.down = True`: every call raises `RemoteUnavailable` (counted by the store's breaker);
- `server.delay_s`: every call takes that long; past the call's deadline (default: the store's
  timeout) it raises `RemoteUnavailable` at the deadline, as the real store does;
- `server.write_gate`, `server.probe_gate`: `threading.Event`s that writes / probes wait for
  (cleared: they stay in flight until set);
- `server.evict(key)`: the value is gone (`BlockMissing` on read, absent to probes);
- `server.corrupt(key)`: one payload byte flipped (`ValueRejected` on read, present to probes).
`server.calls` counts calls per method; `server.forbid_thread(ident)` records (in
`server.violations`) every call made on that thread (the scheduler thread must never do I/O).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable, ValueRejected

__all__ = ["BlockMissing", "FakeServer", "FakeStore", "RemoteUnavailable", "ValueRejected"]


class FakeServer:
    """One shared server: values by (prefix, identity, key), failure switches, call counts."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str, bytes], tuple[bytes, bytes]] = {}  # -> (payload, its digest)
        self.lock = threading.Lock()
        self.down = False
        self.delay_s = 0.0
        self.write_gate = threading.Event()
        self.write_gate.set()
        self.probe_gate = threading.Event()
        self.probe_gate.set()
        self.calls: Counter[str] = Counter()
        self.probe_sizes: list[int] = []
        self.violations: list[str] = []
        self._forbidden: set[int] = set()
        self.stores: list[FakeStore] = []

    def store(self, client: dict[str, Any], **store_args: Any) -> FakeStore:
        """A `ValkeyBackend.store_factory`: a new store on this server."""
        store = FakeStore(self, client, **store_args)
        self.stores.append(store)
        return store

    def forbid_thread(self, ident: int) -> None:
        self._forbidden.add(ident)

    def record_call(self, method: str) -> None:
        """Count a call of `method` in `calls`; one made on a forbidden thread (`forbid_thread`) is
        also listed in `violations`. Every `FakeStore` call records itself; a test's replacement of
        a store method should too."""
        if threading.get_ident() in self._forbidden:
            self.violations.append(f"{method} on {threading.current_thread().name}")
        self.calls[method] += 1

    def keys_of(self, prefix: str | None = None) -> list[bytes]:
        return [k for (p, _i, k) in self.values if prefix is None or p == prefix]

    def evict(self, key: bytes) -> None:
        with self.lock:
            for full in [f for f in self.values if f[2] == key]:
                del self.values[full]

    def corrupt(self, key: bytes) -> None:
        with self.lock:
            for full, value in list(self.values.items()):
                if full[2] == key:
                    data, digest = value
                    self.values[full] = (bytes([data[0] ^ 1]) + data[1:], digest)


class FakeStore:
    """The `RemoteStore` contract over a `FakeServer`, with its circuit breaker."""

    def __init__(self, server: FakeServer, client: dict[str, Any], *, key_prefix: str, fingerprint: str,
                 layout: str, block_bytes: int, tp: int = 1):
        server.record_call("__init__")
        self.server = server
        self.client = client
        self.prefix = key_prefix
        self.identity = f"{fingerprint}|{layout}"
        self.block_bytes = block_bytes
        self.timeout_s = float(client.get("timeout_s", 0.25))
        self.breaker_failures = int(client.get("breaker_failures", 3))
        self.breaker_open_s = float(client.get("breaker_open_s", 5.0))
        self._failures = 0
        self._open_until = 0.0
        self.closed = False
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ the breaker
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _call(self, method: str, deadline: float | None = None) -> None:
        """Breaker and injected failures before a call's work (which must end by `deadline`)."""
        self.server.record_call(method)
        if self.closed:
            raise RemoteUnavailable("store closed")
        if not self.available:
            raise RemoteUnavailable("circuit breaker open", "BreakerOpen")
        limit = self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        delay = self.server.delay_s
        if delay:
            time.sleep(min(delay, limit))
        if delay > limit or limit <= 0:
            self._fail("timed out", "TimeoutError")
        if self.server.down:
            self._fail("connection refused", "ConnectionError")

    def _fail(self, why: str, cause: str) -> None:
        self._failures += 1
        self.counts["failures"] += 1
        if self._failures >= self.breaker_failures:
            self._open_until = time.monotonic() + self.breaker_open_s
            self._failures = 0
            self.counts["breaker_opens"] += 1
        raise RemoteUnavailable(why, cause)

    def _ok(self) -> None:
        self._failures = 0

    def _full(self, key: bytes) -> tuple[str, str, bytes]:
        return (self.prefix, self.identity, bytes(key))

    # ------------------------------------------------------------------ the contract
    def write_block(self, key: bytes, block: memoryview, deadline: float | None = None) -> int:
        self._call("write_block", deadline)
        self.server.write_gate.wait(60)
        data = bytes(block)
        if len(data) != self.block_bytes:
            raise ValueError(f"block of {len(data)} bytes, expected {self.block_bytes}")
        with self.server.lock:
            self.server.values[self._full(key)] = (data, hashlib.sha256(data).digest())
        self._ok()
        return len(data)

    def read_block(self, key: bytes, out: memoryview, deadline: float | None = None) -> int:
        self._call("read_block", deadline)
        with self.server.lock:
            value = self.server.values.get(self._full(key))
        self._ok()
        if value is None:
            raise BlockMissing(f"key {bytes(key).hex()} is gone")
        data, digest = value
        out[:len(data)] = data  # as the real store: `out` may be written before verification fails
        if hashlib.sha256(data).digest() != digest:
            raise ValueRejected(f"key {bytes(key).hex()}: payload checksum mismatch")
        return len(data)

    def probe(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        self._call("probe", deadline)
        self.server.probe_sizes.append(len(keys))
        self.server.probe_gate.wait(60)
        with self.server.lock:
            found = [self._full(k) in self.server.values for k in keys]
        self._ok()
        return found

    def stats(self) -> dict[str, int | float]:
        return dict(self.counts)

    def close(self) -> None:
        self.closed = True


def fake_valkey(server: FakeServer, name: str = "remote", num_blocks: int = 16, block_bytes: int = 4096,
                **options: Any) -> Any:
    """A `ValkeyBackend` whose store is a `FakeStore` on `server` (options as in YAML; `url` and
    `fingerprint` have test defaults)."""
    from kvtier.tiers.remote.backend import ValkeyBackend

    cls = type("FakeValkeyBackend", (ValkeyBackend,), {"store_factory": staticmethod(server.store)})
    options.setdefault("url", "redis://fake:6379")
    options.setdefault("fingerprint", "fake-model")
    return cls(name, num_blocks, block_bytes, 16, **options)
