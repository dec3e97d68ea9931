"""Which server holds a key: one server, or a cluster's slot map.

Single server: every key is on its one `NodeClient`. Cluster: redis-py's `RedisCluster` (cluster
mode, retries off, `require_full_coverage=False`) reads the slot map from the seeds; keys are routed
by their CRC16 key slot (keys carry no hash tags, so they spread over the shards) to one
`NodeClient` per master. The map is copied into a flat table, so routing a key takes no lock and no
I/O. It is reloaded when a server answers MOVED/ASK (a resharding or a failover) and by the store's
reconnect thread while a shard is unreachable (after a failover the new master takes its slots) or
while some slot has no master.
A slot no master covers, or a map not loaded yet, raises `RemoteUnavailable` without I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from kvtier.remote.errors import RemoteUnavailable
from kvtier.remote.nodes import NodeClient, connection_kwargs
from kvtier.remote.options import ClientOptions, Endpoint, ParsedUrl


class Topology:
    """Routes keys to `NodeClient`s. Thread-safe."""

    def __init__(self, options: ClientOptions, parsed: ParsedUrl):
        self.cluster = parsed.cluster
        self._options = options
        self._parsed = parsed
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeClient] = {}
        self._slots: list[NodeClient | None] = []
        self._client: RedisCluster | None = None
        if not self.cluster:
            node = NodeClient(options, parsed.endpoints[0], tls=parsed.tls, db=parsed.db)
            self._nodes[node.name] = node
            self._single: NodeClient | None = node
        else:
            self._single = None
            try:
                self.refresh()
            except RemoteUnavailable:
                pass  # the reconnect thread loads it later; calls raise RemoteUnavailable meanwhile

    @property
    def ready(self) -> bool:
        return self._single is not None or bool(self._slots)

    @property
    def complete(self) -> bool:
        """Every slot has a master (always, for one server)."""
        return self._single is not None or (bool(self._slots) and all(self._slots))

    def nodes(self) -> list[NodeClient]:
        with self._lock:
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
        known master answers."""
        if not self.cluster:
            return
        try:
            with self._lock:
                if self._client is None:
                    kwargs = connection_kwargs(self._options, self._parsed.tls)
                    kwargs.pop("retry")
                    if self._parsed.tls:
                        kwargs["ssl"] = True
                    seeds = [ClusterNode(e.host, e.port) for e in self._parsed.endpoints]
                    self._client = RedisCluster(startup_nodes=seeds, require_full_coverage=False,
                                                retry=Retry(NoBackoff(), 0), **kwargs)
                else:
                    self._client.nodes_manager.initialize()
                self._load_slots(self._client)
        except RemoteUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - redis-py raises several unrelated types here
            raise RemoteUnavailable(f"cluster slot map: {type(exc).__name__}: {exc}") from exc

    def _load_slots(self, client: RedisCluster) -> None:
        cache = client.nodes_manager.slots_cache
        table: list[NodeClient | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for slot, holders in cache.items():
            if not holders:
                continue
            primary = holders[0]
            endpoint = Endpoint(host=primary.host, port=int(primary.port))
            node = self._nodes.get(endpoint.name)
            if node is None:
                node = self._nodes[endpoint.name] = NodeClient(self._options, endpoint, tls=self._parsed.tls)
            table[slot] = node
        if not any(table):
            raise RemoteUnavailable("cluster: the slot map covers no slot")
        self._slots = table

    def close(self) -> None:
        with self._lock:
            for node in self._nodes.values():
                node.close()
            if self._client is not None:
                self._client.close()
                self._client = None
