"""`RemoteStore`: the blocks of one identity on one Valkey/Redis server or cluster.

The contract with the tier that uses it: every method may do socket I/O, never retried; never call
one on the scheduler thread. Each operation (a block's write or read, every part of it; a probe, every
server of it) has one deadline, `deadline` (a `time.monotonic()` value; default `ClientOptions.timeout_s`
from the call), for all of its connecting, sending and receiving (nodes.py).
A block of `block_bytes` is stored as `tp` values, value r = bytes [r*P, (r+1)*P) of the block
(P = block_bytes // tp), each under its own key (keys.py) and carrying its own trailer
(value_format.py). A block is served only when every part verifies.

Failures, per server (one circuit breaker each; a cluster has one per master):
- timeout (the deadline passed), refused connection, authentication or ACL refusal (NOPERM),
  CLUSTERDOWN, TRYAGAIN -> `RemoteUnavailable`, counted toward that server's breaker. An ACL refusal
  counts like an outage: it repeats on every call until the deployment is fixed, so failing fast is
  what saves round trips. A refusal of a GET or SET counts even while probes (EXISTS) succeed: only a
  GET or SET that works resets it. The reconnect check (an EXISTS and a GET in this store's namespace,
  answered within the slow budget, `_check`) keeps the breaker open while the refusal lasts;
- an answer slower than `SLOW_FRACTION` of `timeout_s` -> returned, but counted toward the breaker
  as a failure (`slow`): a server that answers every call just inside the timeout is taken off like
  one that does not answer;
- `OOM command not allowed` (a full server without an eviction policy) -> `RemoteUnavailable`, not
  counted: the server is up and still serves reads;
- MOVED / ASK -> the slot map is reloaded and the call raises `RemoteUnavailable` (not counted); the
  next call goes to the new holder;
- a missing key -> `BlockMissing`; a value that fails verification or is not a string ->
  `ValueRejected`. Neither counts: the server answered.
While a breaker is open, calls that need that server raise `RemoteUnavailable` at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.exceptions import AskError, NoPermissionError

from kvtier.errors import ArgumentError
from kvtier.tiers.remote.breaker import CircuitBreaker, Reconnector
from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable, ValueRejected
from kvtier.tiers.remote.keys import KeyScheme, key_digest
from kvtier.tiers.remote.nodes import NodeClient
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.topology import Topology
from kvtier.tiers.remote.value_format import TRAILER_BYTES, make_trailer, verify_parts

T = TypeVar("T")
_COUNTERS = ("writes", "write_bytes", "reads", "read_bytes", "probes", "probe_keys", "missing", "rejected",
             "failures", "timeouts", "refused", "slow", "full", "redirects", "unavailable_keys")
SLOW_FRACTION = 0.5  # an answer slower than this fraction of timeout_s counts toward the breaker


def _byte_view(buf: memoryview, name: str, nbytes: int, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ArgumentError(f"{name}: needs a C-contiguous buffer")
    if writable and view.readonly:
        raise ArgumentError(f"{name}: needs a writable buffer")
    if view.nbytes != nbytes:
        raise ArgumentError(f"{name}: {view.nbytes} bytes, expected block_bytes = {nbytes}")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class RemoteStore:
    """Blocks of one identity on one server or cluster. Thread-safe; see the module docstring.

    Building one does no I/O: a cluster's slot map is loaded by the reconnect thread (until it is,
    calls raise `RemoteUnavailable`, `available` is False and `reason` says why; `wait_ready` waits
    for it). `close()` stops that thread without waiting for a check or reload in flight (bounded by
    the timeouts, it drops what it opened); a store that is not closed keeps it (a daemon thread) alive.
    """

    def __init__(self, options: ClientOptions, *, key_prefix: str, fingerprint: str, layout: str,
                 block_bytes: int, tp: int = 1):
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes: expected an integer >= 1, got {block_bytes!r}")
        self.keys = KeyScheme(key_prefix, fingerprint, layout, tp)
        if block_bytes % tp:
            raise ValueError(f"block_bytes: {block_bytes} is not a multiple of tp = {tp}")
        self.options = options
        self.block_bytes = block_bytes
        self.tp = tp
        self.part_bytes = block_bytes // tp
        self.slow_s = options.timeout_s * SLOW_FRACTION
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._breakers: dict[str, CircuitBreaker] = {}
        self._closed = False
        self._topology = Topology(options, options.parsed)
        self._reconnector = Reconnector("kvtier-remote-reconnect", self._poll)
        if not self._topology.complete:
            self._reconnector.wake()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a cluster's slot map to load (True at once for one server)."""
        return self._topology.loaded.wait(timeout_s)

    def __repr__(self) -> str:
        return f"RemoteStore({self.options.url!r}, namespace={self.keys.namespace!r}, tp={self.tp})"

    # -- the data path -------------------------------------------------------------------------

    def _deadline(self, deadline: float | None) -> float:
        return time.monotonic() + self.options.timeout_s if deadline is None else deadline

    def write_block(self, key: bytes, block: memoryview, deadline: float | None = None) -> int:
        """SET the `tp` parts of `block` by `deadline`; returns the bytes sent (payload + trailers)."""
        view = _byte_view(block, "block", self.block_bytes, writable=False)
        deadline = self._deadline(deadline)
        sent = 0
        for rank, part_key in enumerate(self.keys.part_keys(key)):
            part = view[rank * self.part_bytes:(rank + 1) * self.part_bytes]
            trailer = make_trailer(part, self.keys.identity, key_digest(part_key))
            node = self._route(part_key)
            self._call(node, node.set_value, part_key, part, trailer, deadline, data=True)
            sent += self.part_bytes + TRAILER_BYTES
        self._count(writes=1, write_bytes=sent)
        return sent

    def read_block(self, key: bytes, out: memoryview, deadline: float | None = None) -> int:
        """GET each part straight into its range of `out` and verify it there, all by `deadline`;
        returns `block_bytes`. `out` may be partly written when this raises (`BlockMissing`,
        `ValueRejected`, `RemoteUnavailable`)."""
        view = _byte_view(out, "out", self.block_bytes, writable=True)
        deadline = self._deadline(deadline)
        for rank, part_key in enumerate(self.keys.part_keys(key)):
            node = self._route(part_key)
            part = view[rank * self.part_bytes:(rank + 1) * self.part_bytes]
            got = self._call(node, node.get_into, part_key, part, TRAILER_BYTES, deadline, data=True)
            if got is None:
                self._count(missing=1)
                raise BlockMissing(f"{part_key.decode()}: not on the server (evicted or never written)")
            try:
                verify_parts(part, got[0], got[1], self.keys.identity, key_digest(part_key))
            except ValueRejected as exc:
                self._count(rejected=1)
                raise ValueRejected(f"{part_key.decode()}: {exc}") from None
        self._count(reads=1, read_bytes=self.block_bytes)
        return self.block_bytes

    def probe(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        """True where every part of the block exists, answered by `deadline`. One pipelined round trip per
        server (EXISTS of every part key), on probe-only connections; on a cluster every server's probe is
        sent before any reply is read, so they run at once. Keys on a server that is unreachable (or whose
        breaker is open) answer False; `RemoteUnavailable` only when no server involved answered."""
        if self._closed:
            raise RemoteUnavailable("remote store closed")
        parts = self.keys.all_part_keys(keys)
        if not parts:
            return []
        found = [False] * len(parts)
        started, deadline = time.monotonic(), self._deadline(deadline)
        groups, unroutable, why = self._topology.group(parts)
        answered, unavailable = 0, len(unroutable)
        errors = [f"{len(unroutable)} keys on no server ({why})"] if unroutable else []
        causes = ["NoSlotMap"] if unroutable else []
        sent = []
        try:
            for name, indices in groups.items():
                node = self._topology.node(name)
                try:
                    pending = self._call(node, node.exists_send, [parts[i] for i in indices], deadline,
                                         answered=False)
                    sent.append((node, indices, pending))
                except RemoteUnavailable as exc:
                    errors.append(str(exc))
                    causes.append(exc.cause)
                    unavailable += len(indices)
            while sent:
                node, indices, pending = sent.pop(0)
                try:
                    replies = self._call(node, node.exists_finish, pending, since=started)
                except RemoteUnavailable as exc:
                    errors.append(str(exc))
                    causes.append(exc.cause)
                    unavailable += len(indices)
                    continue
                answered += 1
                for i, hit in zip(indices, replies):
                    found[i] = hit
        finally:
            for node, _, pending in sent:  # only after an unexpected error
                node.exists_abandon(pending)
        self._count(probes=1, probe_keys=len(keys), unavailable_keys=unavailable)
        if not answered:
            cause = next((c for c in causes if c != "BreakerOpen"), "BreakerOpen" if causes else "")
            raise RemoteUnavailable("probe: no server answered: " + "; ".join(errors), cause)
        tp = self.tp
        return [all(found[i * tp:(i + 1) * tp]) for i in range(len(keys))]

    # -- failures --------------------------------------------------------------------------------

    def _route(self, key: bytes) -> NodeClient:
        if self._closed:
            raise RemoteUnavailable("remote store closed")
        return self._topology.node_for(key)

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

    def _call(self, node: NodeClient, fn: Callable[..., T], *args, answered: bool = True, data: bool = False,
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
            self._count(redirects=1)
            try:
                self._topology.refresh()
            except RemoteUnavailable:
                pass
            raise RemoteUnavailable(f"{node.name}: slot moved ({exc}); slot map reloaded", "SlotMoved") from None
        except redis.OutOfMemoryError as exc:
            breaker.success(data)
            self._count(full=1)
            raise RemoteUnavailable(f"{node.name}: server full (maxmemory without eviction): {exc}",
                                    "OutOfMemoryError") from None
        except (NoPermissionError, redis.AuthenticationError) as exc:
            self._fail(breaker, type(exc).__name__, f"refused: {type(exc).__name__}: {exc}", refused=1)
        except redis.ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):
                breaker.success(data)
                self._count(rejected=1)
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
                self._count(failures=1, slow=1)
                breaker.failure(f"SlowAnswer: answered in {took * 1000:.0f} ms, budget {self.slow_s * 1000:.0f} ms")
            else:
                breaker.success(data)
        return result

    def _fail(self, breaker: CircuitBreaker, cause: str, error: str, **counts: int) -> None:
        self._count(failures=1, **counts)
        breaker.failure(error, refused=bool(counts.get("refused")))
        raise RemoteUnavailable(f"{breaker.name}: {error}", cause)

    def _poll(self) -> float | None:
        """The reconnect thread's step: reload a cluster's map while it is missing or partial, or a shard is out;
        check (`_check`) each server whose breaker is due; seconds until the next due check (None: none open)."""
        if self._closed:
            return None
        breakers = list(self._breakers.values())
        due = [b for b in breakers if (b.seconds_to_check() or 1) <= 0]
        if self._topology.cluster and (not self._topology.complete or due):
            try:
                self._topology.refresh()
            except RemoteUnavailable:
                pass
        for breaker in due:
            try:
                node = self._topology.node(breaker.name)
            except KeyError:
                continue
            breaker.try_close(lambda: self._check(node))  # noqa: B023 - called at once
        waits = [s for s in (b.seconds_to_check() for b in breakers) if s is not None]
        if not self._topology.complete:
            waits.append(self.options.breaker_open_s)
        return min(waits) if waits else None

    def _check(self, node: NodeClient) -> None:
        """The reconnect check of one server: EXISTS and GET of a key of this store's namespace held by
        that server (a PING where it holds no slot), within twice the slow budget. Unlike a bare PING it
        also fails while an ACL refuses the namespace or GET, so a refused store stays off instead of
        reopening every `breaker_open_s`; a slow server stays off too."""
        start = time.monotonic()
        key = self._topology.key_on(node, f"{self.keys.namespace}:health".encode())
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

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    @property
    def available(self) -> bool:
        """False while this store cannot serve anything: closed, no cluster map yet, or every known
        server's breaker open (a cluster with one shard out is still available)."""
        if self._closed or not self._topology.ready:
            return False
        names = [n.name for n in self._topology.nodes()]
        return any(self._breakers.get(n) is None or self._breakers[n].available for n in names)

    @property
    def reason(self) -> str:
        """Why `available` is False ("" while it is True): closed, the slot map's load error, or the
        last error of each open breaker."""
        if self._closed:
            return "remote store closed"
        if not self._topology.ready:
            return self._topology.reason or "cluster slot map not loaded yet; loading in the background"
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
        out["servers"] = len(self._topology.nodes())
        return out

    def close(self) -> None:
        """Idempotent: stops the reconnect thread and closes every connection."""
        if self._closed:
            return
        self._closed = True
        self._reconnector.stop(wait=False)
        self._topology.close()
