"""One host, many engines, one hierarchy: the host owner and an engine's connection to it.

`kvtier serve` runs a `HostOwner` (`owner`): it owns the index, pins and eviction of every shared
hierarchy on the host (one `Namespace` per model identity), and keeps the bytes where engines
map them (its CPU region in /dev/shm; its file tiers' slab files). Engines whose YAML says
`shared: host` (`kvtier.config.shared`) connect with a `HostClient` (`client`): only keys and slot
numbers cross the Unix socket (`wire`, `listener`); each engine copies its blocks in and out of
the region itself (`region`). An owner that does not answer within `timeout_ms` is a miss.
"""
