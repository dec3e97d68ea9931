"""What a failed load does under vLLM: with vLLM's own offloading connector, and with kvtier's.

vLLM 0.32's `OffloadingConnectorWorker` asserts that every transfer succeeded: a failed load stops
the engine, nothing is recomputed (the first test pins that; if it starts failing, vLLM has learnt
to recover by itself). kvtier's `KVTierOffloadingConnector` reports the failure instead, and with
`kv_load_failure_policy: "recompute"` vLLM recomputes the tokens: the end-to-end test runs one
engine whose worker fails its first load (writing random bytes into the destination blocks, so an
engine that used them would answer differently) and checks that the output equals the cold run's
and that the engine then serves a load that succeeds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]


class _FailedLoadWorker:
    """An `OffloadingWorker` whose one finished job is a failed load."""

    def get_finished(self):
        from vllm.v1.kv_offload.base import TransferResult

        return [TransferResult(7, False, 0, 0.0)]


def test_a_failed_load_is_not_recovered_by_the_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    # The connector's worker side, past its constructor (which needs a whole engine config): only
    # the state `get_finished` reads.
    side = object.__new__(OffloadingConnectorWorker)
    side.worker = _FailedLoadWorker()
    side._load_jobs = {7: "request-1"}
    side._connector_worker_meta = None
    with pytest.raises(AssertionError):
        side.get_finished(set())
    # Nor does the connector report failed blocks or requests another way (the scheduler's
    # `kv_load_failure_policy` acts on those only).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert OffloadingConnector.get_block_ids_with_load_errors is KVConnectorBase_V1.get_block_ids_with_load_errors
    assert OffloadingConnector.get_transfer_results is KVConnectorBase_V1.get_transfer_results


sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import build_tiny_model, random_prompt  # noqa: E402
from vllm_e2e_helpers import metric, run_engine, step  # noqa: E402

PROMPT_A = random_prompt(120, seed=11)  # ~380 tokens: 5 full offloaded blocks of 64 tokens
PROMPT_B = random_prompt(120, seed=12)


@pytest.fixture(scope="module")
def failing_engine(tmp_path_factory) -> tuple[dict, str]:
    """One engine with kvtier's connector, a worker that fails its first load, and recompute."""
    workdir = tmp_path_factory.mktemp("vllm_load_failure")
    job = {
        "model": str(build_tiny_model(workdir / "model")), "block_size": 32, "offload_block_size": 64,
        "num_gpu_blocks": 64, "max_model_len": 1024, "max_tokens": 8,
        "connector": {"name": "KVTierOffloadingConnector", "module": "kvtier.integrations.vllm.connector"},
        "kv_load_failure_policy": "recompute",
        "spec": {"name": "FailingLoadSpec", "module": "failing_spec", "extra": {
            "fail_loads": 1,
            "kvtier_config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "64 blocks", "policy": "lru"}]},
        }},
        "steps": [
            {"op": "generate", "name": "A_cold", "prompt": PROMPT_A},
            {"op": "reset"},
            {"op": "generate", "name": "A_failed_load", "prompt": PROMPT_A},
            {"op": "generate", "name": "B_cold", "prompt": PROMPT_B},
            {"op": "reset"},
            {"op": "generate", "name": "B_loaded", "prompt": PROMPT_B},
        ],
    }
    report = run_engine(job, workdir, "failing")
    return report, (workdir / "failing.log").read_text()


@pytest.mark.slow
def test_a_failed_load_is_recomputed_and_the_engine_keeps_serving(failing_engine):
    report, engine_log = failing_engine
    # the load was attempted and failed, and vLLM recovered by recomputing
    assert "kvtier: load job" in engine_log and "failed" in engine_log
    assert "Recovered from KV load failure" in engine_log
    # the random bytes written into the failed load's blocks were not used: same greedy tokens
    assert step(report, "A_failed_load")["tokens"] == step(report, "A_cold")["tokens"]
    # the engine serves on, and a load that succeeds is used
    loaded = step(report, "B_loaded")
    assert loaded["tokens"] == step(report, "B_cold")["tokens"]
    assert metric(loaded, "external_prefix_cache_hits") > 0


@pytest.mark.slow
def test_vllms_own_offload_metric_names_reach_llm_get_metrics(failing_engine):
    report, _ = failing_engine
    # one prepare_store per cold prompt: vLLM's allocation histogram, filled by kvtier
    assert metric(step(report, "A_cold"), "kv_offload_cpu_allocation_size") >= 1
    assert "vllm:kv_offload_cpu_cache_usage_perc" in report["final_metrics"]
    assert "vllm:kvtier_stores[cpu]" in report["final_metrics"]  # beside kvtier's own
