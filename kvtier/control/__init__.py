"""The parts of the hierarchy manager (the control plane), one job each.

- `tier`: `Tier`, one backend in the chain with its policy and all of its per-tier state (which
  copies are clean, the write-through queue, counters), and the operations that keep that state
  consistent (making room, dropping a block).
- `jobs`: `Job`, a copy between two tiers given by slot ids that does its own bookkeeping when it
  ends, the `Demotion` job (the cascade's copy to the next tier), the table of running jobs, and
  the event log. There is one path: every policy is driven through `CachePolicy`'s batch calls
  over slot ids (`pin_loads`, `insert_written`, `release_loads`, `mark_written`, `evict_ids`,
  ...), compiled or pure-Python alike.
- `context`: `ControlContext`, what the controllers share (tiers, job table, events).
- The controllers, peers over that context (none constructs another; the manager composes them):
  - `loads`: `LoadPins`, blocks pinned by `prepare_load` until `complete_load`.
  - `stores`: `StorePath`, the engine's stores into the first tier and the room questions of the
    standalone API.
  - `cascade`: how blocks reach the next tier (`on_evict` reserve refill, `on_store`
    write-through) and the eviction that respects it.
  - `promotion`: copies of lower-tier blocks up into tier 0 for lookups; the `Promotion` job.
  - `shared_probes`: `SharedTierProbes`, a shared (remote) tier after the local ones: publish on
    store (the `Publish` job), batched probes of keys no tier holds, negative answers, failures as
    misses.
- `quiesce`: waiting until the jobs the controllers started have ended (`wait_idle`), and the
  manager's `flush` and `shutdown` built on it.

`kvtier.control.manager.HierarchyManager` puts them together behind the `OffloadingManager` protocol.
"""
