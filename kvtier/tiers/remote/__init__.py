"""The shared tier on Valkey / Redis (one RESP protocol): its backend, its client and its handler.

- `ValkeyBackend` (backend.py; YAML name `valkey`, or `kvtier.tiers.remote:ValkeyBackend`): the tier.
  Its parts: options.py (YAML options and `ClientOptions`), password.py, env.py (`config check
  --env`), probes.py (its probe thread), runtime.py (write pause, failure notices, probe queue).
- The client (below the backend; it imports no tier, handler or control-plane module):
  `RemoteStore` (store.py) keeps the blocks of one identity on one server or cluster (its servers
  under their breakers: guard.py): keys
  (keys.py), values = payload + verified trailer (value_format.py), no client retries, a circuit
  breaker per server (breaker.py), servers (nodes.py) and the cluster slot map (topology.py);
  url.py (URL forms), errors.py; bench.py measures the raw client.
- handler.py: the CPU<->REMOTE transfer handlers (named in kvtier/transfer/registry.py).

The client library is imported by the modules that talk to a server (nodes.py, topology.py,
store.py, bench.py), never by `import kvtier.tiers.remote`. The backend and the client log to
`kvtier.tiers.remote` (breaker and topology to their child loggers).
"""

from kvtier.tiers.remote.backend import ValkeyBackend

__all__ = ["ValkeyBackend"]
