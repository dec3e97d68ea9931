"""`KVTierOffloadingConnector` without an engine: vLLM 0.32's real connector sides and metadata
types, fed a failed load and a failed store, and kvtier's real manager on the scheduler side.

The end-to-end run (tests/integration/test_vllm_load_failure.py) shows vLLM recomputing a failed
load; these pin each hop of the failure: the worker side reports it (no assertion), the metadata
carries it across workers, and the scheduler side turns it into `complete_store(success=False)` or
a dropped block, so nothing a failed job touched is ever answered HIT.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_spec import _config, _keys  # noqa: E402

LOAD, FAILED_STORE, STORE = 7, 8, 9


class _Results:
    """An `OffloadingWorker` whose jobs finish as told: {job_id: success}."""

    def __init__(self, outcomes: dict[int, bool]):
        self.outcomes = outcomes

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        return True

    def wait(self, job_ids):
        return None

    def get_finished(self):
        from vllm.v1.kv_offload.base import TransferResult

        return [TransferResult(j, ok, 100 * j, 0.5) for j, ok in self.outcomes.items()]


def _worker_side(outcomes: dict[int, bool], block_level: bool = True, sync: bool = False):
    """The connector's worker side past its constructor (which needs a whole engine): one load job
    (request r1, engine blocks 3 and 4; with `sync`, vLLM 0.33's load of a running request)
    submitted, then `outcomes` reported by the worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.integrations.vllm.connector import _Worker

    side = object.__new__(_Worker)
    side.worker = _Results(outcomes)
    side._load_jobs, side._unsubmitted_store_jobs = {}, []
    side._connector_worker_meta = OffloadingWorkerMetadata()
    side._adopt(block_level)
    extra = {"sync": True} if sync else {}
    load = TransferJob("r1", object(), GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]), **extra)
    side.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={LOAD: load}, store_jobs={}))
    return side


def test_the_worker_side_reports_failed_jobs_instead_of_asserting():
    side = _worker_side({LOAD: False, FAILED_STORE: False, STORE: True})
    sending, recving = side.get_finished(set())
    assert recving == {"r1"}  # a failed load still ends the request's wait
    assert side.take_failed_blocks() == {3, 4} and side.take_failed_blocks() == set()
    assert side.take_failed_requests() == set()  # one KV-cache group: block ids say it
    meta = side.build_connector_worker_meta()
    assert meta.completed_jobs == {LOAD: 1, FAILED_STORE: 1, STORE: 1}
    assert meta.failed_jobs == {LOAD: None, FAILED_STORE: None}  # (a worker naming no block: every block)
    # only the job that succeeded moved bytes
    assert meta.transfer_stats.store.bytes == 100 * STORE and meta.transfer_stats.load.bytes == 0


def test_with_several_kv_cache_groups_a_failed_load_is_reported_by_request():
    side = _worker_side({LOAD: False}, block_level=False)
    side.get_finished(set())
    assert side.take_failed_requests() == {"r1"}
    assert side.take_failed_blocks() == set()  # vLLM 0.32 refuses block ids of several groups


def _needs_sync_loads():
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    if "sync" not in {f.name for f in dataclasses.fields(TransferJob)}:
        pytest.skip("this vLLM has no sync (expedited) loads: 0.33 added them")


def test_a_failed_sync_load_is_a_load_failure_reported_by_its_blocks():
    """vLLM 0.33 keeps a sync load (passed as `expedited`) with no request id: it is still a
    load. Failed, its blocks are load errors (vLLM recomputes them for the running request);
    succeeded, its bytes count as loaded, not stored."""
    _needs_sync_loads()
    side = _worker_side({LOAD: False}, sync=True)
    assert side.get_finished(set()) == (set(), set())  # no request waits for a sync load
    assert side.take_failed_blocks() == {3, 4}
    assert side.build_connector_worker_meta().failed_jobs == {LOAD: None}
    side = _worker_side({LOAD: True}, sync=True)
    side.get_finished(set())
    stats = side.build_connector_worker_meta().transfer_stats
    assert stats.load.bytes == 100 * LOAD and stats.store.bytes == 0


def test_with_several_kv_cache_groups_a_failed_sync_load_stops_the_engine():
    """vLLM 0.33 takes failed requests only while they wait for KV: a running request's failed
    sync load cannot be reported by request, so the worker side raises instead of letting the
    step compute on blocks that were never loaded."""
    _needs_sync_loads()
    side = _worker_side({LOAD: False}, block_level=False, sync=True)
    with pytest.raises(RuntimeError, match="sync load job 7 failed"):
        side.get_finished(set())


def test_a_job_that_failed_on_one_rank_is_failed_after_aggregation():
    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    rank0 = KVTierWorkerMetadata(completed_jobs={LOAD: 1, STORE: 1}, failed_jobs={LOAD: [b"k2"]})
    rank1 = KVTierWorkerMetadata(completed_jobs={LOAD: 1, STORE: 1})
    merged = rank0.aggregate(rank1)
    assert isinstance(merged, KVTierWorkerMetadata)
    assert merged.completed_jobs == {LOAD: 2, STORE: 2} and merged.failed_jobs == {LOAD: [b"k2"]}
    # each rank names the keys that failed in its part: the job's are the union; "every" wins
    rank1 = KVTierWorkerMetadata(completed_jobs={LOAD: 1}, failed_jobs={LOAD: [b"k1"], STORE: None})
    assert rank0.aggregate(rank1).failed_jobs == {LOAD: [b"k1", b"k2"], STORE: None}
    rank1 = KVTierWorkerMetadata(completed_jobs={LOAD: 1}, failed_jobs={LOAD: None})
    assert rank0.aggregate(rank1).failed_jobs == {LOAD: None}


class _Req:
    def is_finished(self):
        return False


def _scheduler_side(tmp_path):
    """The connector's scheduler side past its constructor, over kvtier's real manager."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    from kvtier.integrations.vllm import KVTierOffloadingSpec
    from kvtier.integrations.vllm.connector import _Scheduler

    spec = KVTierOffloadingSpec(_config(tmp_path, events=False, kvtier_config={"tiers": [
        {"name": "cpu", "backend": "cpu", "capacity": "8 blocks"}]}))
    side = object.__new__(_Scheduler)
    side.manager = spec.get_manager()
    side._jobs, side._req_status, side._stale_job_threshold = {}, {}, 0
    side._block_id_to_pending_jobs, side._chunks_being_loaded = {}, None
    side._connector_stats = OffloadingConnectorStats()
    side._adopt()
    return side


def _job(side, job_id, keys, is_store, ctx):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import TransferJobStatus

    side._jobs[job_id] = TransferJobStatus(req_id="r1", pending_count=1, keys=set(keys), is_store=is_store)
    status = side._req_status.setdefault("r1", SimpleNamespace(req_context=ctx, transfer_jobs=set(), req=_Req(),
                                                                finished_signaled=False))
    status.transfer_jobs.add(job_id)


def _finish(side, completed, failed, bad=None):
    """The workers report the jobs `completed`, `failed` among them (their keys `bad` failed; None: all)."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    meta = KVTierWorkerMetadata(completed_jobs=dict.fromkeys(completed, 1), failed_jobs=dict.fromkeys(failed, bad))
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))


def test_a_failed_store_never_becomes_readable(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    side = _scheduler_side(tmp_path)
    try:
        ctx, good, bad = ReqContext("r1"), _keys(2), _keys(2, start=10)
        for job_id, keys in ((STORE, good), (FAILED_STORE, bad)):
            assert side.manager.prepare_store(keys, ctx).keys_to_store == keys
            _job(side, job_id, keys, True, ctx)
        _finish(side, [STORE, FAILED_STORE], [FAILED_STORE])
        assert [side.manager.lookup(k, ctx) for k in good] == [LookupResult.HIT] * 2
        assert [side.manager.lookup(k, ctx) for k in bad] == [LookupResult.MISS] * 2
        assert not side._jobs  # both jobs done: the request's bookkeeping is released
        # the failed store's slots are free again: 6 more blocks fit next to the 2 good ones
        assert side.manager.prepare_store(_keys(6, start=20), ctx).evicted_keys == []
    finally:
        side.manager.shutdown()


def _loading(side, n: int):
    """`n` blocks stored, then a load job of them (LOAD) waiting for the workers' report."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx, keys = ReqContext("r1"), _keys(n)
    side.manager.prepare_store(keys, ctx)
    side.manager.complete_store(keys, ctx)
    side.manager.prepare_load(keys, ctx)
    _job(side, LOAD, keys, False, ctx)
    return ctx, keys


@pytest.mark.parametrize("failed", [True, False])
def test_a_failed_load_drops_its_blocks_and_a_completed_one_keeps_them(tmp_path, failed):
    from vllm.v1.kv_offload.base import LookupResult

    side = _scheduler_side(tmp_path)
    try:
        ctx, keys = _loading(side, 3)
        _finish(side, [LOAD], [LOAD] if failed else [])
        # after a failure the recompute's lookup misses instead of loading the same blocks again
        expected = LookupResult.MISS if failed else LookupResult.HIT
        assert [side.manager.lookup(k, ctx) for k in keys] == [expected] * 3
        assert side.manager.tier_stats()["cpu"]["resident_blocks"] == (0 if failed else 3)
    finally:
        side.manager.shutdown()


class _NamesFailures(_Results):
    """`_Results` whose failed load names its bad blocks, as kvtier's worker does (`take_failure`)."""

    def __init__(self, outcomes, bad, first):
        super().__init__(outcomes)
        self.failure = (bad, first)

    def take_failure(self, job_id):
        return self.failure


@pytest.mark.parametrize("per_chunk, skip, first, reported", [(1, 0, 1, {4}), (2, 1, 1, {4}),
                                                               (1, 0, 0, {3, 4})])
def test_a_load_that_names_its_bad_block_reports_the_engine_blocks_from_it_on(per_chunk, skip, first, reported):
    """vLLM recomputes from the first invalid engine block: the blocks before the first bad key's
    were loaded and are kept. A key covers `blocks_per_chunk` engine blocks, the first one maybe
    only partly (`block_indices[0] % blocks_per_chunk` skipped)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.integrations.vllm.connector import _Worker

    side = object.__new__(_Worker)
    side.worker = _NamesFailures({LOAD: False}, [b"bad"], first)
    side.spec = SimpleNamespace(blocks_per_chunk=per_chunk)
    side._load_jobs, side._unsubmitted_store_jobs = {}, []
    side._connector_worker_meta = OffloadingWorkerMetadata()
    side._adopt(True)
    load = TransferJob("r1", object(), GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[skip]))
    side.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={LOAD: load}, store_jobs={}))
    side.get_finished(set())
    assert side.take_failed_blocks() == reported
    assert side.build_connector_worker_meta().failed_jobs == {LOAD: [b"bad"]}


def test_a_failed_load_drops_only_its_bad_block_and_lets_the_request_store_it_again(tmp_path):
    """Issue 42, item 3: one bad block in a load of three: only it is dropped (counted once) and
    answers MISS; the others stay HITs; the request's next block to store goes back to it, so
    vLLM's recompute of it is offloaded again (on 7e6c7c1 all three were dropped, none stored)."""
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import LookupResult

    side = _scheduler_side(tmp_path)
    try:
        ctx, keys = _loading(side, 3)
        group = SimpleNamespace(offload_keys=list(keys), next_stored_chunk_idx=3)
        side._req_status["r1"].group_states = (group,)
        _finish(side, [LOAD], [LOAD], bad=[bytes(keys[1])])
        assert [side.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        stats = side.manager.tier_stats()["cpu"]
        assert stats["resident_blocks"] == 2 and stats["failures"] == 1
        assert group.next_stored_chunk_idx == 1
        assert side.manager.prepare_store(keys, ctx).keys_to_store == [keys[1]]  # stored again
    finally:
        side.manager.shutdown()


def test_a_vllm_without_the_fields_the_connector_relies_on_is_refused_at_start():
    from kvtier.integrations.vllm.connector import _Scheduler, _Worker

    scheduler = object.__new__(_Scheduler)
    scheduler.manager, scheduler._jobs, scheduler._req_status = object(), {}, {}  # no _stale_job_threshold: renamed
    with pytest.raises(RuntimeError, match="has no _stale_job_threshold; it supports vLLM 0.32 and 0.33"):
        scheduler._adopt()
    worker = object.__new__(_Worker)
    with pytest.raises(RuntimeError, match="has no worker, _load_jobs, _connector_worker_meta"):
        worker._adopt(True)


class _Waiting(_Results):
    """`_Results` that also records kvtier's idle-step wait (`wait_for_file_loads`)."""

    def __init__(self, outcomes):
        super().__init__(outcomes)
        self.waits: list[float] = []

    def wait_for_file_loads(self, timeout):
        self.waits.append(timeout)


def _connector(worker_side=None, scheduler_side=None):
    from kvtier.integrations.vllm.connector import KVTierOffloadingConnector

    connector = object.__new__(KVTierOffloadingConnector)
    connector.connector_worker, connector.connector_scheduler = worker_side, scheduler_side
    return connector


@pytest.mark.parametrize("scheduled", [0, 1, 512])
def test_a_step_is_marked_idle_only_when_nothing_is_scheduled(scheduled):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "total_num_scheduled_tokens" in SchedulerOutput.__dataclass_fields__  # the field the mark reads
    built = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    scheduler = SimpleNamespace(build_connector_meta=lambda output: built)
    meta = _connector(scheduler_side=scheduler).build_connector_meta(
        SimpleNamespace(total_num_scheduled_tokens=scheduled))
    assert meta is built and meta.engine_idle is (scheduled == 0)


@pytest.mark.parametrize("idle", [True, False, None])
def test_an_idle_step_waits_for_the_direct_file_loads_before_collecting(idle):
    """Only on a step with nothing scheduled does the worker side wait (bounded) for a direct file
    load in flight; the jobs are collected after the wait, in the same call."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

    from kvtier.integrations.vllm.connector import IDLE_WAIT_S

    side = _worker_side({LOAD: True})
    side.worker = worker = _Waiting({LOAD: True})
    connector = _connector(worker_side=side)
    meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    if idle is not None:  # (None: a metadata without the mark, e.g. built by another scheduler side)
        meta.engine_idle = idle
    connector.bind_connector_metadata(meta)
    results = connector.get_transfer_results(set())
    assert worker.waits == ([IDLE_WAIT_S] if idle else [])
    assert results.finished_recving == {"r1"}
    assert 0 < IDLE_WAIT_S <= 0.05  # a request arriving meanwhile waits at most this long
