"""A kvtier spec whose worker fails chosen load jobs, for the load-failure tests under vLLM.

`FailingLoadSpec` is `KVTierOffloadingSpec` with one difference in the worker: the first
`fail_loads` load jobs (`kv_connector_extra_config.fail_loads`, default 1) are not copied; their
destination engine blocks are filled with random bytes instead and the job is reported with
`success=False`. An engine that used those blocks anyway would produce other tokens than a
recompute, so comparing outputs with a cold run tests that vLLM recomputed them.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import TransferResult

from kvtier.integrations.vllm import KVTierOffloadingSpec, KVTierOffloadingWorker


class _FailingLoadWorker(KVTierOffloadingWorker):
    def __init__(self, spec: Any, kv_caches: Any, fail_loads: int):
        super().__init__(spec, kv_caches)
        self.loads_to_fail = fail_loads
        self.failed: list[TransferResult] = []

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        if self.loads_to_fail <= 0:
            return super().submit_load(job_id, src_spec, dst_spec, expedited)
        import torch

        self.loads_to_fail -= 1
        rows = torch.as_tensor(list(dst_spec.block_ids), dtype=torch.long)
        for canonical in self.kv_caches.tensors:
            tensor = canonical.tensor
            noise = torch.randint(-128, 128, (len(rows), tensor.shape[1]), dtype=torch.int8, device=tensor.device)
            tensor[rows] = noise
        self.failed.append(TransferResult(job_id, False, 0, 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        failed, self.failed = self.failed, []
        return failed + super().get_finished()


class FailingLoadSpec(KVTierOffloadingSpec):
    """`KVTierOffloadingSpec` whose worker fails its first `fail_loads` loads (see the module docstring)."""

    own_extra_keys = ("fail_loads",)

    def __init__(self, config: Any):
        super().__init__(config)
        self.failing_worker: _FailingLoadWorker | None = None

    def get_worker(self, kv_caches: Any) -> Any:
        if self.failing_worker is None:
            fail_loads = int(self.extra_config.get("fail_loads", 1))
            self.failing_worker = _FailingLoadWorker(self, kv_caches, fail_loads)
        return self.failing_worker

    def shutdown(self) -> None:
        worker, self.failing_worker = self.failing_worker, None
        if worker is not None:
            worker.shutdown()
        super().shutdown()
