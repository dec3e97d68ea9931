"""CPU <-> FILE handlers: copy blocks between a host-memory backend and a file tier.

The host side is any `HostSlots` backend (MemoryBackend, the shared-memory CPUBackend); the file
side any `BlockFile` backend (FileBackend); see `kvtier.tiers.base`. `spec.tier` names the backend of
each side. Each job runs on the handler's pool;
an exception inside a job (disk full, EIO, a block failing verification) fails that job only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvtier.core.errors import BlocksFailed, IntegrityError
from kvtier.core.specs import BlockIDsLoadStoreSpec, LoadStoreSpec
from kvtier.tiers.base import BlockFile, HostSlots
from kvtier.tiers.file.spec import FileLoadStoreSpec
from kvtier.transfer.handlers.base import ThreadedHandler, host_pair, serving


class _CPUFileHandler(ThreadedHandler):
    def __init__(self, hosts: dict, files: dict, num_threads: int):
        super().__init__(num_threads=num_threads, thread_name=f"kvtier-{type(self).__name__}")
        self.hosts = hosts
        self.files = files

    def _sides(self, cpu: BlockIDsLoadStoreSpec, file: FileLoadStoreSpec):
        return host_pair(self.hosts, self.files, cpu, file, "file")


class CPUToFileHandler(_CPUFileHandler):
    """Writes host-memory blocks into file slots (demotion, write-through); journalled when the job ends
    (found again after a killed process; fdatasync'ed per the file tier's `sync_interval`)."""

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        assert isinstance(src, BlockIDsLoadStoreSpec) and isinstance(dst, FileLoadStoreSpec), "the registered pair"
        host, disk = self._sides(src, dst)
        return disk.write_blocks(dst.block_ids, dst.keys, [host.view(s) for s in src.block_ids])


class FileToCPUHandler(_CPUFileHandler):
    """Reads and verifies file blocks into host-memory slots (promotion); blocks that fail
    verification fail alone (`BlocksFailed`: the others were read and verified)."""

    def copy(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> int:
        assert isinstance(src, FileLoadStoreSpec) and isinstance(dst, BlockIDsLoadStoreSpec), "the registered pair"
        host, disk = self._sides(dst, src)
        try:
            return disk.read_blocks(src.block_ids, src.keys, [host.view(s) for s in dst.block_ids])
        except IntegrityError as exc:
            raise failed_slots(exc, src.block_ids, disk.block_bytes) from exc


def failed_slots(exc: IntegrityError, slots: Sequence[int], block_bytes: int) -> BlocksFailed:
    """The `BlocksFailed` of a job over `slots` whose read raised `exc`: the positions of the slots
    it names (all of them when it names none), the bytes of the others."""
    bad = set(exc.slots)
    positions = [i for i, slot in enumerate(slots) if slot in bad] if bad else list(range(len(slots)))
    return BlocksFailed(str(exc), positions, (len(slots) - len(positions)) * block_bytes)


def _make(cls, backends: Mapping, kv_caches=None):
    hosts, files = serving(backends, HostSlots), serving(backends, BlockFile)
    if not hosts or not files:
        return None
    threads = max(b.num_threads for b in files.values())
    return cls(hosts, files, num_threads=threads)


def make_cpu_to_file(backends: Mapping, kv_caches=None) -> CPUToFileHandler | None:
    """Registry factory for (CPULoadStoreSpec, FileLoadStoreSpec); None without both kinds of backend."""
    return _make(CPUToFileHandler, backends, kv_caches)


def make_file_to_cpu(backends: Mapping, kv_caches=None) -> FileToCPUHandler | None:
    """Registry factory for (FileLoadStoreSpec, CPULoadStoreSpec); None without both kinds of backend."""
    return _make(FileToCPUHandler, backends, kv_caches)
