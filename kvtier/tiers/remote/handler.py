"""CPU <-> REMOTE handlers: copy blocks between a host-memory backend and a shared remote tier.

The host side is any `HostSlots` backend; the remote side any `RemoteBlocks` backend
(`ValkeyBackend`); see `kvtier.tiers.base`. CPU -> REMOTE publishes the first tier's blocks, REMOTE
-> CPU promotes them back. Jobs run on the handler's own pool (socket I/O never happens on the
caller's thread). A job must end within the remote tier's `probe_timeout_s` of being submitted (its
deadline goes to `get_blocks` / `put_blocks`): a promotion queued behind others fails when its time
is up instead of making its lookup wait, and a publish leaves unsent what it could not write by
then, so nothing in flight holds up `close()` for longer. An exception inside a job (server
unreachable, a value gone or failing verification) fails that job only, and the manager then answers
MISS for its keys.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvtier.core.specs import BlockIDsLoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import HostSlots, RemoteBlocks
from kvtier.tiers.remote.spec import RemoteLoadStoreSpec
from kvtier.transfer.handlers.base import ThreadedHandler, host_pair, serving


class _CPURemoteHandler(ThreadedHandler):
    def __init__(self, hosts: dict, remotes: dict, num_threads: int):
        super().__init__(num_threads=num_threads, thread_name=f"kvtier-{type(self).__name__}")
        self.hosts = hosts
        self.remotes = remotes
        self._timeout_s = max(r.probe_timeout_s for r in remotes.values())  # (there is one shared tier)
        self._deadlines: dict[int, float] = {}  # id(src spec) -> when its job must end (spec alive till then)

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self._deadlines[id(src)] = time.monotonic() + self._timeout_s
        super().submit(job_id, src, dst)

    def _deadline(self, src: LoadStoreSpec) -> float | None:
        """The deadline stamped when the job of `src` was submitted (None: copied without `submit`)."""
        return self._deadlines.pop(id(src), None)

    def _sides(self, cpu: BlockIDsLoadStoreSpec, remote: RemoteLoadStoreSpec):
        host, store = host_pair(self.hosts, self.remotes, cpu, remote, "remote")
        for ids, side in ((cpu.block_ids, host), (remote.block_ids, store)):
            if ids and max(ids) >= side.num_blocks:
                raise ValueError(f"slot {max(ids)} is past the end of {side.name} ({side.num_blocks} slots)")
        return host, store


class CPUToRemoteHandler(_CPURemoteHandler):
    """Publishes host-memory blocks to the remote tier under their keys."""

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        assert isinstance(src, BlockIDsLoadStoreSpec) and isinstance(dst, RemoteLoadStoreSpec), "the registered pair"
        deadline = self._deadline(src)
        host, store = self._sides(src, dst)
        return store.put_blocks(dst.keys, [host.view(s) for s in src.block_ids], deadline)


class RemoteToCPUHandler(_CPURemoteHandler):
    """Reads and verifies remote blocks into host-memory slots (promotion)."""

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        assert isinstance(src, RemoteLoadStoreSpec) and isinstance(dst, BlockIDsLoadStoreSpec), "the registered pair"
        deadline = self._deadline(src)
        host, store = self._sides(dst, src)
        return store.get_blocks(src.keys, [host.view(s) for s in dst.block_ids], deadline)


def _make(cls, backends: Mapping, kv_caches=None):
    hosts, remotes = serving(backends, HostSlots), serving(backends, RemoteBlocks)
    if not hosts or not remotes:
        return None
    return cls(hosts, remotes, num_threads=max(b.num_threads for b in remotes.values()))


def make_cpu_to_remote(backends: Mapping, kv_caches=None) -> CPUToRemoteHandler | None:
    """Registry factory for (CPULoadStoreSpec, RemoteLoadStoreSpec); None without both kinds of backend."""
    return _make(CPUToRemoteHandler, backends, kv_caches)


def make_remote_to_cpu(backends: Mapping, kv_caches=None) -> RemoteToCPUHandler | None:
    """Registry factory for (RemoteLoadStoreSpec, CPULoadStoreSpec); None without both kinds of backend."""
    return _make(RemoteToCPUHandler, backends, kv_caches)
