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
- an answer slower than `SLOW_FRACTION` (guard.py) of `timeout_s` -> returned, but counted toward the breaker
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

import time
from collections.abc import Sequence

from kvtier.core.errors import ArgumentError
from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable, ValueRejected
from kvtier.tiers.remote.guard import ServerGuard
from kvtier.tiers.remote.keys import KeyScheme, key_digest
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.value_format import TRAILER_BYTES, make_trailer, verify_parts


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
        self.servers = ServerGuard(options, self.keys.namespace)  # breakers, reconnects, counters
        self.slow_s = self.servers.slow_s

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a cluster's slot map to load (True at once for one server)."""
        return self.servers.topology.loaded.wait(timeout_s)

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
            node = self.servers.route(part_key)
            self.servers.call(node, node.set_value, part_key, part, trailer, deadline, data=True)
            sent += self.part_bytes + TRAILER_BYTES
        self.servers.count(writes=1, write_bytes=sent)
        return sent

    def read_block(self, key: bytes, out: memoryview, deadline: float | None = None) -> int:
        """GET each part straight into its range of `out` and verify it there, all by `deadline`;
        returns `block_bytes`. `out` may be partly written when this raises (`BlockMissing`,
        `ValueRejected`, `RemoteUnavailable`)."""
        view = _byte_view(out, "out", self.block_bytes, writable=True)
        deadline = self._deadline(deadline)
        for rank, part_key in enumerate(self.keys.part_keys(key)):
            node = self.servers.route(part_key)
            part = view[rank * self.part_bytes:(rank + 1) * self.part_bytes]
            got = self.servers.call(node, node.get_into, part_key, part, TRAILER_BYTES, deadline, data=True)
            if got is None:
                self.servers.count(missing=1)
                raise BlockMissing(f"{part_key.decode()}: not on the server (evicted or never written)")
            try:
                verify_parts(part, got[0], got[1], self.keys.identity, key_digest(part_key))
            except ValueRejected as exc:
                self.servers.count(rejected=1)
                raise ValueRejected(f"{part_key.decode()}: {exc}") from None
        self.servers.count(reads=1, read_bytes=self.block_bytes)
        return self.block_bytes

    def probe(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        """True where every part of the block exists, answered by `deadline`. One pipelined round trip per
        server (EXISTS of every part key), on probe-only connections; on a cluster every server's probe is
        sent before any reply is read, so they run at once. Keys on a server that is unreachable (or whose
        breaker is open) answer False; `RemoteUnavailable` only when no server involved answered."""
        if self.servers.closed:
            raise RemoteUnavailable("remote store closed")
        parts = self.keys.all_part_keys(keys)
        if not parts:
            return []
        found = [False] * len(parts)
        started, deadline = time.monotonic(), self._deadline(deadline)
        groups, unroutable, why = self.servers.topology.group(parts)
        answered, unavailable = 0, len(unroutable)
        errors = [f"{len(unroutable)} keys on no server ({why})"] if unroutable else []
        causes = ["NoSlotMap"] if unroutable else []
        sent = []
        try:
            for name, indices in groups.items():
                node = self.servers.topology.node(name)
                try:
                    pending = self.servers.call(node, node.exists_send, [parts[i] for i in indices], deadline,
                                         answered=False)
                    sent.append((node, indices, pending))
                except RemoteUnavailable as exc:
                    errors.append(str(exc))
                    causes.append(exc.cause)
                    unavailable += len(indices)
            while sent:
                node, indices, pending = sent.pop(0)
                try:
                    replies = self.servers.call(node, node.exists_finish, pending, since=started)
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
        self.servers.count(probes=1, probe_keys=len(keys), unavailable_keys=unavailable)
        if not answered:
            cause = next((c for c in causes if c != "BreakerOpen"), "BreakerOpen" if causes else "")
            raise RemoteUnavailable("probe: no server answered: " + "; ".join(errors), cause)
        tp = self.tp
        return [all(found[i * tp:(i + 1) * tp]) for i in range(len(keys))]

    # -- state (the servers') -------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while this store cannot serve anything: closed, no cluster map yet, or every known
        server's breaker open (a cluster with one shard out is still available)."""
        return self.servers.available

    @property
    def reason(self) -> str:
        """Why `available` is False ("" while it is True): closed, the slot map's load error, or the
        last error of each open breaker."""
        return self.servers.reason

    def stats(self) -> dict[str, int | float]:
        """The servers' counters (`ServerGuard.stats`)."""
        return self.servers.stats()

    def close(self) -> None:
        """Idempotent: stops the reconnect thread and closes every connection."""
        self.servers.close()
