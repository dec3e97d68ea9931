"""The data layer of the shared tier on Valkey / Redis (one RESP protocol).

`RemoteStore` (store.py) keeps the blocks of one identity on one server or cluster: keys
(keys.py), values = payload + verified trailer (value_format.py), no client retries, a circuit
breaker per server (breaker.py). Nothing here imports the control plane, the manager or the tiers;
the `valkey` backend (kvtier/tiers) builds on it. The client library is imported by the modules
that talk to a server (nodes.py, topology.py, store.py), not by this package.
"""

from kvtier.remote.errors import BlockMissing, RemoteUnavailable, ValueRejected
from kvtier.remote.options import ClientOptions

__all__ = ["BlockMissing", "ClientOptions", "RemoteUnavailable", "ValueRejected"]
