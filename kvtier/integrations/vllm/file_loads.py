"""The worker's direct file loads: file-tier blocks read by the worker process itself, read-only,
verified, and scattered into its KV cache (issue 38: every executor, every tensor-parallel rank).

The scheduler side keeps sole ownership of each file tier (index, pins, writes: its
`FileBackend`); a load spec names slots, the keys their headers must carry, and the identity of
the tier's manifest (`KVTierFileLoadStoreSpec.identity`), never a path. The worker opens each
file tier of its own configuration with a `kvtier.tiers.file.reader.SlabReader` (root_dir and the
expected manifest derived from the same `kv_connector_extra_config` as the scheduler's, hence
trusted; read-only descriptors, the tier's own checks), for its part of each slot: rank `r` of
`world_size` reads bytes `[r * rank_bytes, (r + 1) * rank_bytes)` and verifies exactly those
against the slot's part checksum (`FileBackend(part_checks=world_size)`, which the connector sets).
A block stays pinned by the scheduler until the load completes, so its slot is not reused while
a worker reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.transfer.router import Abandoned

if TYPE_CHECKING:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec
    from kvtier.tiers.file.reader import SlabReader

log = logging.getLogger(__name__)


def direct_file_tiers(config: Any) -> list[int]:
    """The indices of `config`'s tiers that a worker may load directly: plain `file` tiers (a
    subclass of `FileBackend` may write another slot format; those are promoted)."""
    from kvtier.tiers.file import FileBackend
    from kvtier.transfer import registry

    return [i for i, tier in enumerate(config.tiers)
            if i > 0 and registry.load_class(registry.BACKEND, tier.backend, f"tiers[{i}].backend") is FileBackend]


def open_readers(spec: KVTierOffloadingSpec) -> dict[str, SlabReader]:
    """A `SlabReader` of this rank's part of each directly loaded file tier of the spec's config,
    checked against the manifest the scheduler's tier writes (the same derivation:
    `hierarchy.backend_options`, `FileBackend.expected_manifest`). Raises (`ConfigError`,
    `KVTierError`, `OSError`) naming the tier and what was wrong; none is left open then."""
    from kvtier.control.hierarchy import backend_options, describe_layout
    from kvtier.tiers.file import FileBackend
    from kvtier.tiers.file.reader import SlabReader

    config = spec.hierarchy_config
    layout = describe_layout(spec.block_bytes, config.block_tokens)
    readers: dict[str, SlabReader] = {}
    try:
        for i in direct_file_tiers(config):
            tier, options = config.tiers[i], backend_options(config, i, layout)
            wanted = FileBackend.expected_manifest(tier.capacity.to_blocks(spec.block_bytes), spec.block_bytes,
                                                   config.block_tokens, options)
            reader = SlabReader(tier.name, options["root_dir"], wanted, (spec.rank, spec.num_copies),
                                min(4, int(options.get("num_threads", 4))))
            readers[tier.name] = reader
            log.info("kvtier worker rank %d: file tier %s opened read-only in %s (%s, part %d of %d, verified per "
                     "part)", spec.rank, tier.name, reader.root, "O_DIRECT" if reader.io.direct else "buffered",
                     spec.rank, spec.num_copies)
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return readers


class FileLoads:
    """The worker's direct file loads over its `SlabReader`s. `GPUFileHandler.stage_load` reads
    every file block of a job into a staging buffer and verifies its header (key) and checksum,
    and copies a composite's CPU slots into the same buffer, on this object's threads; the scatter
    into the KV cache (`finish_load`) runs when the job is collected (`poll`, `wait`), on the
    engine's thread, as the CPU tier's loads do theirs (in `submit`), rather than on a pool thread
    where each of its short torch calls waits for the GIL behind the engine's busy steps
    (docs/vllm.md, "Measured", has the reload phases both ways). A job whose read or verification
    failed, or whose spec names another tier identity than the one opened, is reported
    `success=False`, the KV cache untouched (the connector reports it, vLLM recomputes)."""

    def __init__(self, handler: Any, threads: int, readers: Mapping[str, Any] | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.handler = handler
        self.readers = dict(readers or {})
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-file-load")
        self._jobs: dict[int, tuple[Any, float]] = {}  # job id -> (its stage_load future, start)
        self._done: list[Any] = []  # results collected by `wait`, for the next `poll`

    @classmethod
    def open(cls, spec: KVTierOffloadingSpec, region: Any, layout: Any) -> FileLoads:
        """Readers of the spec's file tiers (`open_readers`) and a loading handler over them and
        the attached CPU `region`, with `layout` (this rank's range of each slot)."""
        from kvtier.transfer.handlers.gpu_file import GPUFileHandler

        readers = open_readers(spec)
        try:
            threads = min(4, max([r.num_threads for r in readers.values()], default=1))
            handler = GPUFileHandler({region.name: region, **readers}, layout, to_file=False, num_threads=threads)
        except BaseException:
            for reader in readers.values():
                reader.close()
            raise
        return cls(handler, threads, readers)

    def submit(self, source: Any, gpu: Any, job_id: int, identities: Mapping[str, bytes] | None = None) -> int:
        """Start reading job `job_id` (its file parts must be of the tiers `identities` names)."""
        future = self._pool.submit(self._stage, source, gpu, dict(identities or {}))
        self._jobs[job_id] = (future, time.perf_counter())
        return job_id

    def _stage(self, source: Any, gpu: Any, identities: dict[str, bytes]) -> Any:
        for tier, identity in identities.items():
            reader = self.readers.get(tier)
            if reader is None:
                from kvtier.core.errors import KVTierError

                raise KVTierError(f"a load names file tier {tier!r}, which this worker does not read (it reads "
                                  f"{', '.join(self.readers) or 'none'})")
            reader.check_identity(identity)
        return self.handler.stage_load(source, gpu)

    def poll(self) -> list[Any]:
        for job_id in [j for j, (future, _) in self._jobs.items() if future.done()]:
            self._finish(job_id)
        done, self._done = self._done, []
        return done

    def wait(self, job_ids) -> None:
        for job_id in [j for j in job_ids if j in self._jobs]:
            self._finish(job_id)

    def wait_any(self, timeout: float) -> None:
        """Block (GIL released) until a job in flight has been read and verified, at most
        `timeout` seconds; its scatter is left to the next `poll`. Returns at once with none in flight."""
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        if self._jobs:
            wait_futures([future for future, _ in self._jobs.values()], timeout, FIRST_COMPLETED)

    def _finish(self, job_id: int) -> None:
        from kvtier.core.types import TransferResult as KVTierResult
        from kvtier.transfer.handlers.base import failed_result

        future, start = self._jobs.pop(job_id)
        try:
            size = self.handler.finish_load(*future.result())
        except Exception as exc:  # noqa: BLE001 - fails this job only
            log.warning("kvtier: direct file load job %d failed: %s: %s", job_id, type(exc).__name__, exc)
            self._done.append(failed_result(job_id, start, exc))
        else:
            self._done.append(KVTierResult(job_id, True, size, time.perf_counter() - start))

    def shutdown(self, timeout: float | None = None) -> Abandoned:
        """Stop once the reads in flight end, at most `timeout` seconds (None: no limit); the jobs
        still reading then are abandoned (returned; their thread finishes the read later, and
        the readers stay open for it)."""
        from concurrent.futures import wait as wait_futures

        futures = {future: job_id for job_id, (future, _) in self._jobs.items()}
        _, running = wait_futures(list(futures), timeout)
        self._pool.shutdown(wait=not running, cancel_futures=True)
        if not running:
            self.handler.shutdown()
            for reader in self.readers.values():
                reader.close()
        return Abandoned([f"direct file load job {futures[f]}" for f in running])
