"""Which server holds a key: one server, or a cluster's slot map.

Single server: every key is on its one `NodeClient`. Cluster: redis-py's `NodesManager` (the part
of `RedisCluster` that reads the slot map; `RedisCluster` itself also sends COMMAND to one node, which
fails while that node hangs) reads the slot map from the seeds, trying each in turn; keys are routed
by their CRC16 key slot (keys carry no hash tags, so they spread over the shards) to one
`NodeClient` per master. The map is copied into a flat table, so routing a key takes no lock and no
I/O. It is reloaded when a server answers MOVED/ASK (a resharding or a failover; a MOVED reply's new
holder is also applied to its slot at once, so the next call lands even when the reload fails) and by the store's
reconnect thread while a shard is unreachable (after a failover the new master takes its slots) or
while some slot has no master.
A slot no master covers, or a map not loaded yet, raises `RemoteUnavailable` without I/O.

Locks: a reload holds `_reload_lock` across its socket I/O (it only serialises reloads); it builds the
new table and node set aside and swaps them in as plain attributes, so readers (`node_for`, `nodes`,
`node`, `ready`, the scheduler thread's `RemoteStore.available`) take no lock that I/O holds. Building
a `Topology` does no I/O: the store's reconnect thread loads a cluster's map. A reload that fails logs
one WARNING when the map goes from loaded (or never tried) to failing, with the reason; `reason` keeps it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import redis
from redis.cluster import ClusterNode, NodesManager, cleanup_kwargs
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvtier.tiers.remote.errors import RemoteUnavailable, authentication_problem
from kvtier.tiers.remote.nodes import NodeClient, connection_kwargs
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.url import Endpoint, ParsedUrl

log = logging.getLogger(__name__)


class Topology:
    """Routes keys to `NodeClient`s. Thread-safe."""

    def __init__(self, options: ClientOptions, parsed: ParsedUrl):
        self.cluster = parsed.cluster
        self._options = options
        self._parsed = parsed
        self._lock = threading.Lock()  # guards the swaps below and `_closed`; never held across I/O
        self._reload_lock = threading.Lock()  # one reload at a time; held across socket I/O
        self._nodes: dict[str, NodeClient] = {}  # replaced, never mutated: readers copy it without a lock
        self._slots: list[NodeClient | None] = []
        # slot -> master named by a MOVED reply since the reload in flight began: that reload may read
        # a node that lags, so these are applied over what it loads (`moved`, `_load_slots`)
        self._moves: dict[int, Endpoint] = {}
        self._client: NodesManager | None = None
        self._closed = False
        self._failing = False
        self.loaded = threading.Event()  # set once a cluster map has loaded (at once for one server)
        self.reason = ""  # why the last reload failed ("" after a successful one)
        if not self.cluster:
            node = NodeClient(options, parsed.endpoints[0], tls=parsed.tls, db=parsed.db)
            self._nodes = {node.name: node}
            self._single: NodeClient | None = node
            self.loaded.set()
        else:
            self._single = None

    @property
    def ready(self) -> bool:
        return self._single is not None or bool(self._slots)

    @property
    def complete(self) -> bool:
        """Every slot has a master (always, for one server)."""
        return self._single is not None or (bool(self._slots) and all(self._slots))

    def nodes(self) -> list[NodeClient]:
        return list(self._nodes.values())

    def node_for(self, key: bytes) -> NodeClient:
        if self._single is not None:
            return self._single
        slots = self._slots
        if not slots:
            raise RemoteUnavailable("cluster slot map not loaded yet (no seed answered); retrying in the background")
        node = slots[key_slot(key)]
        if node is None:
            raise RemoteUnavailable(f"cluster: slot {key_slot(key)} is covered by no master")
        return node

    def group(self, keys: Sequence[bytes]) -> tuple[dict[str, list[int]], list[int], str]:
        """Indices of `keys` by server name, the indices no server can take now, and why not."""
        groups: dict[str, list[int]] = {}
        unroutable: list[int] = []
        why = ""
        for i, key in enumerate(keys):
            try:
                groups.setdefault(self.node_for(key).name, []).append(i)
            except RemoteUnavailable as exc:
                unroutable.append(i)
                why = str(exc)
        return groups, unroutable, why

    def key_on(self, node: NodeClient, base: bytes) -> bytes | None:
        """`base`, or `base:N` with the smallest N whose slot `node` holds; None if it holds none."""
        if self._single is not None:
            return base
        slots = self._slots
        if node not in slots:
            return None
        for n in range(1 << 16):
            key = b"%s:%d" % (base, n)
            if slots[key_slot(key)] is node:
                return key
        return None

    def node(self, name: str) -> NodeClient:
        return self._nodes[name]

    def refresh(self) -> None:
        """Reload a cluster's slot map (no-op for one server); `RemoteUnavailable` when no seed or
        known master answers. Blocks only callers of `refresh` (module docstring)."""
        if not self.cluster:
            return
        with self._reload_lock:
            try:
                if self._closed:
                    raise RemoteUnavailable("remote store closed")
                client = self._client
                if client is None:
                    kwargs = connection_kwargs(self._options, self._parsed.tls)
                    kwargs.pop("retry")
                    if self._parsed.tls:
                        kwargs["ssl"] = True
                    seeds = [ClusterNode(e.host, e.port) for e in self._parsed.endpoints]
                    client = NodesManager(startup_nodes=seeds, require_full_coverage=False,
                                          **cleanup_kwargs(**kwargs))
                    with self._lock:
                        closed, self._client = self._closed, None if self._closed else client
                    if closed:
                        client.close()
                        raise RemoteUnavailable("remote store closed")
                else:
                    with self._lock:
                        self._moves.clear()  # (moves from now on are newer than what this reload reads)
                    client.initialize()
                self._load_slots(client)
            except Exception as exc:  # noqa: BLE001 - redis-py raises several unrelated types here
                error = exc if isinstance(exc, RemoteUnavailable) else self._unavailable(exc)
                self._failed(str(error))
                raise error from exc
            self._loaded()

    def _unavailable(self, exc: Exception) -> RemoteUnavailable:
        """The `RemoteUnavailable` of a reload that failed with `exc` (redis-py's, its last seed's
        error as its cause): a refused authentication says what is wrong and how to fix it
        (`authentication_problem`, cause `AuthenticationError`), as does a seed not in cluster mode."""
        cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        if isinstance(cause, redis.AuthenticationError):
            problem = authentication_problem(str(cause), self._options.password is not None)
            return RemoteUnavailable(f"cluster slot map: {problem}", "AuthenticationError")
        if "Cluster mode is not enabled" in str(exc):
            return RemoteUnavailable(f"cluster slot map: {type(exc).__name__}: {exc} (a cluster:// url names nodes of "
                                     f"a cluster; for one server use redis:// or rediss://)", "NotCluster")
        return RemoteUnavailable(f"cluster slot map: {type(exc).__name__}: {exc}")

    def moved(self, slot: int, host: str, port: int) -> None:
        """A server answered MOVED: `slot`'s master is now `host:port`. Applied to the table at once
        (no I/O), as redis-py's own cluster client does, so that the next call for the slot lands
        even when the reload that follows a redirect fails or reads a node that lags; a reply that
        names no host (`?` or empty: the server does not know its endpoint) changes nothing."""
        if self._single is not None or host in ("", "?") or not 0 <= slot < REDIS_CLUSTER_HASH_SLOTS:
            return
        with self._lock:
            if self._closed or not self._slots:
                return
            nodes, table = dict(self._nodes), list(self._slots)  # (replaced, never mutated: readers take no lock)
            table[slot] = self._node_in(nodes, Endpoint(host=host, port=port))
            self._nodes, self._slots = nodes, table
            self._moves[slot] = Endpoint(host=host, port=port)

    def _node_in(self, nodes: dict[str, NodeClient], endpoint: Endpoint) -> NodeClient:
        """The client of `endpoint` in `nodes`, added to it when new (no I/O: it connects on use)."""
        node = nodes.get(endpoint.name)
        if node is None:
            node = nodes[endpoint.name] = NodeClient(self._options, endpoint, tls=self._parsed.tls)
        return node

    def _failed(self, reason: str) -> None:
        self.reason = reason
        if not self._failing and not self._closed:
            self._failing = True
            then = "routing by the last map" if self._slots else "every call is a miss until it loads"
            log.warning("%s: cannot load the cluster slot map (%s); %s, retrying in the background",
                        self._options.redacted_url, reason, then)

    def _loaded(self) -> None:
        self.reason = ""
        self.loaded.set()
        if self._failing:
            self._failing = False
            log.warning("%s: cluster slot map loaded", self._options.redacted_url)

    def _load_slots(self, client: NodesManager) -> None:
        cache = client.slots_cache
        table: list[NodeClient | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        nodes = dict(self._nodes)
        for slot, holders in cache.items():
            if not holders:
                continue
            primary = holders[0]
            table[slot] = self._node_in(nodes, Endpoint(host=primary.host, port=int(primary.port)))
        if not any(table):
            raise RemoteUnavailable("cluster: the slot map covers no slot")
        with self._lock:
            if not self._closed:
                for slot, endpoint in self._moves.items():  # (MOVED replies during the reload win)
                    table[slot] = self._node_in(nodes, endpoint)
                self._nodes, self._slots = nodes, table
                return
        for node in nodes.values():  # closed meanwhile: drop what this reload opened
            node.close()

    def close(self) -> None:
        """Closes every connection without waiting for a reload in flight (it closes its own)."""
        with self._lock:
            self._closed = True
            nodes, client, self._client = list(self._nodes.values()), self._client, None
        for node in nodes:
            node.close()
        if client is not None:
            client.close()
