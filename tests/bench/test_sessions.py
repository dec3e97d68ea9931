"""Session workloads (`kvtier.bench.sessions`) and hinted replays (`replay_kvtier(hints=...)`,
`kvtier bench trace --workload/--hints/--retain-s`)."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.optimum import ends_known, optimum
from kvtier.bench.replay import replay_kvtier
from kvtier.bench.session_report import compare
from kvtier.bench.sessions import WORKLOADS, SessionHints, SessionTrace, generate_session_trace, load_session_trace
from kvtier.bench.workloads import TraceError
from kvtier.cli.main import main
from kvtier.config import parse_config


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generators_are_deterministic_per_seed(name):
    a, b = generate_session_trace(name, seed=3, scale=0.1), generate_session_trace(name, seed=3, scale=0.1)
    assert (a.requests, a.arrivals, a.sessions, a.tenants, a.last_turn) == \
        (b.requests, b.arrivals, b.sessions, b.tenants, b.last_turn)
    assert generate_session_trace(name, seed=4, scale=0.1).arrivals != a.arrivals


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_generated_sessions_extend_their_prefix_and_flag_their_last_turn(name):
    trace = generate_session_trace(name, seed=1, scale=0.1)
    n = len(trace.requests)
    assert len(trace.arrivals) == len(trace.sessions) == len(trace.tenants) == len(trace.last_turn) == n
    assert all(b >= a for a, b in zip(trace.arrivals, trace.arrivals[1:]))
    previous: dict[str, list[int]] = {}
    last_seen: dict[str, int] = {}
    for i, (blocks, session) in enumerate(zip(trace.requests, trace.sessions)):
        if session is None:
            assert not trace.last_turn[i]
            continue
        before = previous.get(session)
        if before is not None:
            assert len(blocks) > len(before) and blocks[:len(before)] == before, "a turn extends its session"
            assert not trace.last_turn[last_seen[session]], "only the last turn is flagged"
        previous[session], last_seen[session] = blocks, i
    assert all(trace.last_turn[i] for i in last_seen.values())
    assert trace.gaps() and 0 < trace.retain_s() <= 3600


def test_head_cuts_every_list():
    trace = generate_session_trace("chat", seed=1, scale=0.1)
    head = trace.head(50)
    assert head.requests == trace.requests[:50] and head.arrivals == trace.arrivals[:50]
    assert head.sessions == trace.sessions[:50] and head.last_turn == trace.last_turn[:50]
    assert len(head.tenants) == 50 and len(head.gaps()) < len(trace.gaps())


def test_scans_share_no_block_with_anything():
    trace = generate_session_trace("mixed-scans", seed=2, scale=0.1)
    scans = [set(r) for r, s in zip(trace.requests, trace.sessions) if s is None]
    others = set().union(*(set(r) for r, s in zip(trace.requests, trace.sessions) if s is not None))
    assert scans and all(not scan & others for scan in scans)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_sessions_are_inferred_from_the_prefix_chain(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1536, "hash_ids": [1, 2, 3]},  # 3 full blocks
        {"timestamp": 500, "input_length": 1400, "hash_ids": [1, 9]},  # shares only block 1: a new session
        {"timestamp": 2000, "input_length": 2000, "hash_ids": [1, 2, 3, 4]},  # extends the first; last partial
        {"timestamp": 3500, "input_length": 2600, "hash_ids": [1, 2, 3, 5, 6]},  # has 3's last full block, not 4
    ])
    trace = load_session_trace(path)
    assert trace.arrivals == [0.0, 0.5, 2.0, 3.5]
    s = trace.sessions
    assert s[0] == s[2] == s[3] != s[1]
    assert trace.last_turn == [False, True, False, True]
    assert trace.gaps() == [2.0, 1.5]


def test_a_trace_without_timestamps_names_the_line(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"timestamp": 0, "hash_ids": [1]}, {"hash_ids": [1, 2]}])
    with pytest.raises(TraceError, match=r"t.jsonl:2: sessions need arrival times"):
        load_session_trace(path)


CAPACITY = 8


def _crafted(flush_at: float, gap: float) -> SessionTrace:
    """Session "a" (4 blocks) at 0 s; from `flush_at` s on, one-time requests of 3 new blocks each
    that flush an LRU of `CAPACITY` blocks; then session "a"'s last turn at `gap` s."""
    requests = [[1, 2, 3, 4]] + [[100 + 3 * k, 101 + 3 * k, 102 + 3 * k] for k in range(5)] + [[1, 2, 3, 4, 5]]
    arrivals = [0.0] + [flush_at + 0.1 * k for k in range(5)] + [gap]
    sessions: list[str | None] = ["a"] + [None] * 5 + ["a"]
    return SessionTrace("crafted", requests, arrivals=arrivals, sessions=sessions, tenants=["t"] * 7,
                        last_turn=[False] * 6 + [True])


def _replay(trace: SessionTrace, retain_s: float | None, one_shot: bool = False):
    config = parse_config({"block_tokens": 512, "tiers": [{"name": "cpu", "backend": "memory",
                                                           "capacity": f"{CAPACITY} blocks", "policy": "lru"}]})
    hints = None if retain_s is None else SessionHints(trace, retain_s, one_shot=one_shot)
    return replay_kvtier(config, trace, hints=hints)


def test_hints_keep_a_session_that_the_same_replay_without_them_loses():
    trace = _crafted(flush_at=1.0, gap=5.0)
    plain, hinted = _replay(trace, None), _replay(trace, retain_s=10)
    first_turn = len(trace.requests[0])
    assert plain["hit_blocks"] == 0  # the one-time requests flushed it
    assert hinted["hit_blocks"] == plain["hit_blocks"] + first_turn
    assert hinted["retention"]["ended"] == 1  # the last turn ended the session
    assert "retention" not in plain


def test_retention_expires_on_the_trace_clock():
    """The flush comes 20 s of trace time after the first turn (the replay takes milliseconds):
    past a 10 s retention the session gets no protection."""
    trace = _crafted(flush_at=20.0, gap=25.0)
    plain, hinted = _replay(trace, None), _replay(trace, retain_s=10)
    assert hinted["hit_blocks"] == plain["hit_blocks"] == 0
    assert hinted["retention"]["expired"] == 1


def test_one_time_requests_hinted_as_one_shot_sessions_go_first_and_spare_the_session():
    """The same flush past the retention, its requests hinted as sessions ended at their first
    turn: their own blocks are the first victims, so the session's blocks are never needed."""
    trace = _crafted(flush_at=20.0, gap=25.0)
    hinted = _replay(trace, retain_s=10, one_shot=True)
    assert hinted["hit_blocks"] == len(trace.requests[0]) and hinted["retention"]["expired"] == 1
    assert hinted["retention"]["evicted_ended"] > 0


def test_ends_known_is_between_lru_and_the_optimum_and_spares_what_is_used_again():
    trace = _crafted(flush_at=1.0, gap=5.0)
    assert ends_known(trace, CAPACITY) == len(trace.requests[0]) / trace.total_blocks  # the session's 4 hits
    assert _replay(trace, None)["hit_rate"] < ends_known(trace, CAPACITY) <= optimum(trace, CAPACITY)


def test_gap_closed_is_measured_from_vllms_best():
    runs = [{"system": "vllm", "policy": "lru", "capacity_blocks": 10, "hit_rate": 0.4},
            {"system": "vllm", "policy": "arc", "capacity_blocks": 10, "hit_rate": 0.5},
            {"system": "kvtier", "policy": "lru", "hints": False, "capacity_blocks": 10, "hit_rate": 0.499},
            {"system": "kvtier", "policy": "lru", "hints": True, "capacity_blocks": 10, "hit_rate": 0.6}]
    report = compare(runs, [{"capacity_blocks": 10, "hit_rate": 0.9}])
    row = report["by_capacity"][0]
    assert row["vllm_best"] == 0.5
    assert row["gap_closed"]["lru"] == pytest.approx((0.6 - 0.5) / (0.9 - 0.5))
    check = report["no_hints_vs_vllm_best"]["lru"]
    assert check["worst_margin"] == pytest.approx(0.499 - 0.5) and check["within"] and not check["above"]
    assert compare(runs, [{"capacity_blocks": 10, "hit_rate": 0.5}])["by_capacity"][0]["gap_closed"]["lru"] is None


@pytest.mark.parametrize("argv, message", [
    (["--workload", "agentc"], "--workload: 'agentc' is not a workload; choose from multiturn, agentic, chat, "
                               "mixed-scans"),
    (["--workload", "chat", "--trace", "sample"], "--workload: give --workload or --trace, not both"),
    (["--workload", "chat", "--hints", "yes"], "--hints: 'yes' is not one of off, on, both"),
    (["--hints", "on"], "--hints: needs sessions: --workload agentic|chat|mixed-scans"),
    (["--workload", "chat", "--retain-s", "0"], "--retain-s: '0' is not auto or a number of seconds from 1 to 3600"),
    (["--workload", "chat", "--retain-s", "soon"], "--retain-s: 'soon' is not auto or a number of seconds"),
    (["--workload", "chat", "--retain-s", "nan"], "--retain-s: 'nan' is not auto"),
    # (before: taken, with no effect: no request carries a hint)
    (["--workload", "chat", "--retain-s", "30"], "--retain-s: applies to hinted replays: give --hints on"),
])
def test_session_options_are_checked_up_front(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main(["bench", "trace", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_trace_replays_a_workload_with_and_without_hints(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--config", "configs/replay-cpu.yaml", "--workload", "agentic", "--quick",
                 "--limit", "300", "--capacities", "100", "--hints", "both", "--retain-s", "30",
                 "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())["trace"]
    assert sorted(r["hints"] for r in doc["runs"]) == [False, True]
    sessions = doc["sessions"]
    assert sessions["from"] == "generated" and sessions["retain_s"] == 30 and sessions["hints"] == "both"
    row = sessions["by_capacity"][0]
    assert set(row["kvtier"]) == set(row["kvtier_hints"]) == {"lru"}
    assert "lru+hints" in capsys.readouterr().out
