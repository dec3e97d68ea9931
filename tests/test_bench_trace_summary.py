"""What a session replay reports: the Summary states the hinted runs' hit rates against the optimum
(before: only the runs without hints), and no 'gap closed' with '-' when vLLM did not run; the plot
draws hinted and unhinted runs of one policy as two lines ('lru', 'lru+hints'; before: one line
through both); a trace in which no session has two turns says what its hints can do (before: a
sessions table with 'retain_s 0' and 'hints on' as if they meant something)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.session_report import compare, summary
from kvtier.cli.main import main

ONE_TIER = "configs/replay-cpu.yaml"


def _bench(tmp_path, *argv):
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", ONE_TIER, "--quick", "--json", str(out), "--no-progress",
                 *argv]) == 0
    return json.loads(out.read_text())


def test_the_summary_states_the_hinted_hit_rate_against_the_optimum(tmp_path, capsys):
    doc = _bench(tmp_path, "--workload", "chat", "--limit", "300", "--hints", "on", "--capacities", "100,400")
    optimum = {o["capacity_blocks"]: o["hit_rate"] for o in doc["trace"]["optimum"]}
    for r in doc["trace"]["runs"]:
        line = f"lru+hints @ {r['capacity_blocks']} tier-0 blocks: hit rate {r['hit_rate']:.1%}"
        assert any(s.startswith(line) and f"of the offline optimum {optimum[r['capacity_blocks']]:.1%}" in s
                   for s in doc["summary"]), doc["summary"]
    assert not any("gap to the optimum closed" in s for s in doc["summary"])
    assert "gap closed" not in capsys.readouterr().out


def test_no_gap_sentence_without_vllm_and_a_plain_one_with_it():
    runs = [{"system": "kvtier", "policy": "lru", "hints": True, "capacity_blocks": 10, "hit_rate": 0.6}]
    report = compare(runs, [{"capacity_blocks": 10, "hit_rate": 0.9}])
    assert summary(report, "t") == []
    with_vllm = runs + [{"system": "vllm", "policy": "lru", "capacity_blocks": 10, "hit_rate": 0.5}]
    assert summary(compare(with_vllm, [{"capacity_blocks": 10, "hit_rate": 0.9}]), "t") == [
        "t @ 10 blocks: with hints, gap to the optimum closed (1 = all of it, from vLLM's best): lru 0.25"]
    assert summary(compare(with_vllm, [{"capacity_blocks": 10, "hit_rate": 0.5}]), "t") == [
        "t @ 10 blocks: no gap for hints to close (vLLM's best 0.5000 reaches the optimum)"]


def test_the_plot_draws_hinted_runs_apart(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.bench.plot import plot_bench

    made = []
    real_subplots = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(real_subplots(*a, **k)) or made[-1])
    runs = [{"system": "kvtier", "policy": "lru", "hints": hinted, "capacity_blocks": cap,
             "hit_rate": rate, "tiers": {"cpu": {"hit_rate": rate}}}
            for hinted, rates in ((False, (0.1, 0.2)), (True, (0.3, 0.4))) for cap, rate in zip((10, 20), rates)]
    plot_bench({"trace": {"trace": "t", "runs": runs, "optimum": [], "optimum_hit_rate": 0.5}}, tmp_path / "p.png")
    (_, axes), = made
    lines = {line.get_label(): list(line.get_ydata()) for line in axes[0][0].get_lines()}
    assert lines["lru: all tiers"] == [0.1, 0.2]
    assert lines["lru+hints: all tiers"] == [0.3, 0.4]


def _no_shared_turns(tmp_path):
    path = tmp_path / "nosess.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "hash_ids": ids}) + "\n"
                            for i, ids in enumerate(([1, 2], [3], [4]))))
    return str(path)


def test_a_trace_without_a_second_turn_says_hints_keep_nothing(tmp_path, capsys):
    doc = _bench(tmp_path, "--trace", _no_shared_turns(tmp_path), "--hints", "on", "--capacities", "10")
    sessions = doc["trace"]["sessions"]
    assert sessions["sessions"] == 3 and sessions["gap_p50_s"] is None
    note = "no session has two turns: hints keep nothing for a next turn"
    assert sessions["note"].startswith(note) and "every session ends at its only turn" in sessions["note"]
    assert any(note in s for s in doc["summary"])
    assert f"note: {note}" in capsys.readouterr().out


def test_live_sessions_without_a_gap_say_that_auto_releases_them(tmp_path):
    doc = _bench(tmp_path, "--workload", "chat", "--limit", "3", "--hints", "on", "--capacities", "10")
    sessions = doc["trace"]["sessions"]
    assert sessions["retain_s"] == 0
    assert "--retain-s auto found no gap between turns to measure, so a turn that does not end its session " \
           "releases it (retain_s 0)" in sessions["note"]
    given = _bench(tmp_path, "--workload", "chat", "--limit", "3", "--hints", "on", "--capacities", "10",
                   "--retain-s", "30")["trace"]["sessions"]
    assert given["retain_s"] == 30 and "retain_s 0" not in given["note"]


def test_a_trace_with_second_turns_has_no_such_note(tmp_path):
    doc = _bench(tmp_path, "--workload", "chat", "--limit", "300", "--hints", "on", "--capacities", "100")
    assert "note" not in doc["trace"]["sessions"]
