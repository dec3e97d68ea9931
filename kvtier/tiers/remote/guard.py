"""`ServerGuard`: the servers of one `RemoteStore` under their circuit breakers.

Every server command of the store runs through `call`, which maps the client library's errors to
`RemoteUnavailable` / `ValueRejected` (store.py's module docstring lists them), counts them, and
feeds the server's breaker (breaker.py): a slow answer counts as a failure. The reconnect thread
(`_poll`) reloads a cluster's slot map while it is missing or partial and checks each server whose
breaker is due, with a read of the store's namespace, so a server refusing it stays off. `available`,
`reason` and `stats` describe the servers for the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.exceptions import AskError, MovedError, NoPermissionError

from kvtier.tiers.remote.breaker import CircuitBreaker, Reconnector
from kvtier.tiers.remote.errors import RemoteUnavailable, ValueRejected, authentication_problem
from kvtier.tiers.remote.nodes import NodeClient
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.topology import Topology

T = TypeVar("T")
COUNTERS = ("writes", "write_bytes", "reads", "read_bytes", "probes", "probe_keys", "missing", "rejected",
            "failures", "timeouts", "refused", "slow", "full", "redirects", "unavailable_keys")
SLOW_FRACTION = 0.5  # an answer slower than this fraction of timeout_s counts toward the breaker


class ServerGuard:
    """The servers `options` names (one, or a cluster's masters) under one breaker each, for the
    store of `namespace`. Building one does no I/O: a cluster's slot map is loaded by the reconnect
    thread. Thread-safe."""

    def __init__(self, options: ClientOptions, namespace: str):
        self.options = options
        self.namespace = namespace
        self.slow_s = options.timeout_s * SLOW_FRACTION
        self.closed = False
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._breakers: dict[str, CircuitBreaker] = {}
        self.topology = Topology(options, options.parsed)
        self._reconnector = Reconnector("kvtier-remote-reconnect", self._poll)
        if not self.topology.complete:
            self._reconnector.wake()

    # -- failures --------------------------------------------------------------------------------

    def route(self, key: bytes) -> NodeClient:
        """The server that holds `key` (RemoteUnavailable once closed or while no server is known for it)."""
        if self.closed:
            raise RemoteUnavailable("remote store closed")
        return self.topology.node_for(key)

    def _breaker(self, name: str) -> CircuitBreaker:
        breaker = self._breakers.get(name)
        if breaker is None:
            with self._lock:
                breaker = self._breakers.get(name)
                if breaker is None:
                    breaker = CircuitBreaker(name, self.options.breaker_failures, self.options.breaker_open_s,
                                             on_open=lambda: self._reconnector.wake())
                    self._breakers[name] = breaker
        return breaker

    def call(self, node: NodeClient, fn: Callable[..., T], *args, answered: bool = True, data: bool = False,
              since: float | None = None) -> T:
        """Run one server command under `node`'s breaker; map client errors (module docstring).
        `answered=False`: `fn` only sent something (a success proves nothing, the reply may never come);
        `data`: a GET or SET (refusals are counted apart, see breaker.py); `since`: when the operation
        began (default: now), for the slow budget."""
        breaker = self._breaker(node.name)
        breaker.guard()
        start = time.monotonic() if since is None else since
        try:
            result = fn(*args)
        except AskError as exc:  # MovedError is an AskError
            breaker.success(data)
            self.count(redirects=1)
            try:
                self.topology.refresh()
            except RemoteUnavailable:
                pass
            if isinstance(exc, MovedError):  # (after the reload: the reply is the newer word on its slot)
                self.topology.moved(exc.slot_id, exc.host, exc.port)
            raise RemoteUnavailable(f"{node.name}: slot moved ({exc}); slot map reloaded", "SlotMoved") from None
        except redis.OutOfMemoryError as exc:
            breaker.success(data)
            self.count(full=1)
            raise RemoteUnavailable(f"{node.name}: server full (maxmemory without eviction): {exc}",
                                    "OutOfMemoryError") from None
        except redis.AuthenticationError as exc:
            problem = authentication_problem(str(exc), self.options.password is not None)
            self._fail(breaker, "AuthenticationError", f"refused: AuthenticationError: {problem}", refused=1)
        except NoPermissionError as exc:
            self._fail(breaker, type(exc).__name__, f"refused: {type(exc).__name__}: {exc}", refused=1)
        except redis.ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                breaker.success(data)
                self.count(rejected=1)
                raise ValueRejected(f"{node.name}: the key holds a value that is not a string") from None
            self._fail(breaker, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        except redis.TimeoutError as exc:
            self._fail(breaker, "TimeoutError", f"TimeoutError: no answer within {self.options.timeout_s} s: {exc}",
                       timeouts=1)
        except (redis.RedisError, OSError) as exc:
            self._fail(breaker, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        if answered:
            took = time.monotonic() - start
            if took > self.slow_s:
                self.count(failures=1, slow=1)
                breaker.failure(f"SlowAnswer: answered in {took * 1000:.0f} ms, budget {self.slow_s * 1000:.0f} ms")
            else:
                breaker.success(data)
        return result

    def _fail(self, breaker: CircuitBreaker, cause: str, error: str, **counts: int) -> None:
        self.count(failures=1, **counts)
        breaker.failure(error, refused=bool(counts.get("refused")))
        raise RemoteUnavailable(f"{breaker.name}: {error}", cause)

    def _poll(self) -> float | None:
        """The reconnect thread's step: reload a cluster's map while it is missing or partial, or a shard is out;
        check (`_check`) each server whose breaker is due; seconds until the next due check (None: none open)."""
        if self.closed:
            return None
        breakers = list(self._breakers.values())
        due = [b for b in breakers if (b.seconds_to_check() or 1) <= 0]
        if self.topology.cluster and (not self.topology.complete or due):
            try:
                self.topology.refresh()
            except RemoteUnavailable:
                pass
        for breaker in due:
            try:
                node = self.topology.node(breaker.name)
            except KeyError:
                continue
            breaker.try_close(lambda: self._check(node))  # noqa: B023 - called at once
        waits = [s for s in (b.seconds_to_check() for b in breakers) if s is not None]
        if not self.topology.complete:
            waits.append(self.options.breaker_open_s)
        return min(waits) if waits else None

    def _check(self, node: NodeClient) -> None:
        """The reconnect check of one server: EXISTS and GET of a key of this store's namespace held by
        that server (a PING where it holds no slot), within twice the slow budget. Unlike a bare PING it
        also fails while an ACL refuses the namespace or GET, so a refused store stays off instead of
        reopening every `breaker_open_s`; a slow server stays off too."""
        start = time.monotonic()
        key = self.topology.key_on(node, f"{self.namespace}:health".encode())
        if key is None:
            node.ping()
        else:
            node.exists([key])
            node.get_into(key, memoryview(bytearray()), 0)  # refused too while an ACL refuses GET
        took = time.monotonic() - start
        if took > 2 * self.slow_s:  # (two round trips)
            raise RemoteUnavailable(f"SlowAnswer: the check took {took * 1000:.0f} ms, budget "
                                    f"{2 * self.slow_s * 1000:.0f} ms")

    # -- state -----------------------------------------------------------------------------------

    def count(self, **counts: int) -> None:
        """Add to the counters `stats` reports."""
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    @property
    def available(self) -> bool:
        """False while this store cannot serve anything: closed, no cluster map yet, or every known
        server's breaker open (a cluster with one shard out is still available)."""
        if self.closed or not self.topology.ready:
            return False
        names = [n.name for n in self.topology.nodes()]
        return any(self._breakers.get(n) is None or self._breakers[n].available for n in names)

    @property
    def reason(self) -> str:
        """Why `available` is False ("" while it is True): closed, the slot map's load error, or the
        last error of each open breaker."""
        if self.closed:
            return "remote store closed"
        if not self.topology.ready:
            return self.topology.reason or "cluster slot map not loaded yet; loading in the background"
        if self.available:
            return ""
        return "; ".join(f"{b.name}: circuit breaker open (last: {b.last_error})" for b in list(self._breakers.values())
                         if not b.available)

    def stats(self) -> dict[str, int | float]:
        """Counters since construction: writes / write_bytes (payload + trailers sent), reads /
        read_bytes, probes / probe_keys, missing (BlockMissing), rejected (ValueRejected), failures
        (counted toward a breaker), of which timeouts and refused (auth / ACL); full (OOM on a write),
        redirects (MOVED / ASK), unavailable_keys (probe parts whose server could not answer);
        breaker_opens / breaker_closes / fast_fails (calls refused while open) / breakers_open (now),
        servers (known masters)."""
        with self._lock:
            out: dict[str, int | float] = dict(self._counts)
        breakers = list(self._breakers.values())
        out["breaker_opens"] = sum(b.opens for b in breakers)
        out["breaker_closes"] = sum(b.closes for b in breakers)
        out["fast_fails"] = sum(b.fast_fails for b in breakers)
        out["breakers_open"] = sum(not b.available for b in breakers)
        out["servers"] = len(self.topology.nodes())
        return out

    def breakers(self) -> list[CircuitBreaker]:
        """The breakers made so far, one per server that was called."""
        return list(self._breakers.values())

    def close(self) -> None:
        """Idempotent: stops the reconnect thread and closes every connection."""
        if self.closed:
            return
        self.closed = True
        self._reconnector.stop(wait=False)
        self.topology.close()
