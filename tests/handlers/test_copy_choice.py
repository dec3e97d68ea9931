"""The copy mechanism chosen by measurement (`fast_path.FastPathChoice` with a timer, and
`copy_timing`): on CPU with stand-in mechanisms and fake timings. The real mechanisms are timed
on a GPU by the `gpu` test at the end and by `scripts/gpu_check.sh`."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_fast_path import Corrupting, Memmove, Raising, host_check

from kvtier.transfer.handlers import copy_timing, fast_path
from kvtier.transfer.handlers.copy_plan import coalesce
from kvtier.transfer.handlers.copy_timing import Timing, pick, probe_blocks, probe_plans, probe_sizes, time_mechanism

torch = pytest.importorskip("torch")


def named(name: str, base=Memmove):
    return type(name, (base,), {"name": name})


def fake_timer(seconds: dict):
    """A timer giving each mechanism the seconds `seconds[name]` (each direction half of it);
    a value that is an exception is raised instead."""
    timed: list[str] = []

    def timer(submitter) -> Timing:
        timed.append(submitter.name)
        value = seconds[submitter.name]
        if isinstance(value, Exception):
            raise value
        return Timing(16 << 20, value / 2, value / 2)

    timer.timed = timed  # type: ignore[attr-defined]
    return timer


def test_the_fastest_mechanism_that_passed_the_self_check_is_chosen(caplog):
    """The corrupting one would be fastest: it is never timed nor chosen; the others are timed and
    the fastest wins; one WARNING names what was left out, with every figure."""
    choice = fast_path.FastPathChoice()
    slow, fast, corrupt = named("batch"), named("loop"), named("kernel", Corrupting)
    candidates = [("batch", slow), ("kernel", corrupt), ("loop", fast)]
    timer = fake_timer({"batch": 0.010, "loop": 0.004, "kernel": 0.001})
    with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.fast_path"):
        chosen = choice.get(("cuda:0", (65536,)), candidates, host_check, timer)
        assert choice.get(("cuda:0", (65536,)), candidates, host_check, timer) is chosen  # decided once
    assert type(chosen) is fast and timer.timed == ["batch", "loop"]
    decision = choice.decisions()[("cuda:0", (65536,))]
    assert [name for name, _ in decision.timings] == ["batch", "loop"]
    assert decision.timings[1][1].as_dict()["d2h_gbps"] == pytest.approx((16 << 20) / 0.002 / 1e9)
    (record,) = caplog.records
    text = record.getMessage()
    assert record.levelno == logging.WARNING and "kernel: CopyError" in text and "wrong byte" in text
    assert "using loop (measured here: batch: D2H 3.4 GB/s, H2D 3.4 GB/s; loop: D2H 8.4 GB/s" in text


def test_without_failures_the_choice_and_its_figures_are_logged_at_info(caplog):
    choice = fast_path.FastPathChoice()
    timer = fake_timer({"batch": 0.002, "loop": 0.004})
    with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.fast_path"):
        chosen = choice.get("cuda:3", [("batch", named("batch")), ("loop", named("loop"))], host_check, timer)
    assert chosen.name == "batch"
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == ("engine<->CPU copies on cuda:3: batch (measured here: batch: D2H 16.8 GB/s, "
                                   "H2D 16.8 GB/s; loop: D2H 8.4 GB/s, H2D 8.4 GB/s)")


def test_a_mechanism_raising_while_timed_is_left_out_with_one_warning(caplog):
    choice = fast_path.FastPathChoice()
    timer = fake_timer({"batch": RuntimeError("CUDA error: invalid argument"), "loop": 0.004})
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
        chosen = choice.get("cuda:0", [("batch", named("batch")), ("loop", named("loop"))], host_check, timer)
    assert chosen.name == "loop"
    (record,) = caplog.records
    assert "batch: RuntimeError while timed: CUDA error: invalid argument" in record.getMessage()
    everything_fails = fake_timer({"batch": RuntimeError("700"), "loop": RuntimeError("701")})
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
        assert choice.get("cuda:1", [("batch", named("batch")), ("loop", named("loop"))], host_check,
                          everything_fails) is None
    assert len(caplog.records) == 2 and "staged path" in caplog.records[1].getMessage()


def test_no_mechanism_left_means_the_staged_path_and_none_is_timed(caplog):
    choice = fast_path.FastPathChoice()
    timer = fake_timer({})
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
        assert choice.get("cuda:0", [("batch", Raising), ("kernel", Corrupting)], host_check, timer) is None
    assert timer.timed == [] and len(caplog.records) == 1


def test_pick_prefers_the_earlier_candidate_within_the_margin():
    t = lambda s: Timing(1, s / 2, s / 2)  # noqa: E731
    assert pick([("batch", t(1.00)), ("loop", t(0.98))]) == "batch"  # 2 % faster: noise
    assert pick([("batch", t(1.00)), ("loop", t(0.90))]) == "loop"
    assert pick([("batch", t(0.50)), ("loop", t(0.90)), ("kernel", t(0.49))]) == "batch"
    assert pick([]) is None


def test_the_probe_has_the_layouts_pages_scattered_and_unmerged():
    pages = (4096, 65536)
    blocks = probe_blocks(pages)
    assert blocks == (16 << 20) // (4096 + 65536)
    assert probe_blocks((512,)) == copy_timing.MAX_PROBE_BLOCKS and probe_blocks((8 << 20,)) == 2
    engine_bytes, host_bytes = probe_sizes(pages)
    engine = torch.randint(0, 256, (engine_bytes,), dtype=torch.uint8)
    host = torch.zeros(host_bytes, dtype=torch.uint8)
    to_host, to_engine = probe_plans(pages, engine.data_ptr(), host.data_ptr())
    assert len(to_host) == 2 * blocks == len(coalesce(to_host.src, to_host.dst, to_host.size))
    assert to_host.nbytes == engine_bytes and np.array_equal(to_engine.src, to_host.dst)
    original = engine.clone()
    Memmove().submit(to_host, 0)
    headers = host.view(blocks, -1)[:, :copy_timing.SLOT_HEADER]
    assert int(headers.sum()) == 0  # no page over a slot's header
    engine.zero_()
    Memmove().submit(to_engine, 0)
    assert torch.equal(engine, original)


def test_a_mechanism_is_timed_both_ways_after_a_warm_up():
    pages = (65536,)
    engine_bytes, host_bytes = probe_sizes(pages)
    engine, host = torch.zeros(engine_bytes, dtype=torch.uint8), torch.zeros(host_bytes, dtype=torch.uint8)
    mechanism, syncs = Memmove(), []
    timing = time_mechanism(mechanism, pages, engine.data_ptr(), host.data_ptr(), 7, lambda: syncs.append(1),
                            repeats=2)
    assert mechanism.plans == 6 and len(syncs) == 6  # per direction: one warm-up, two timed
    assert timing.nbytes == engine_bytes and timing.d2h_s > 0 and timing.h2d_s > 0
    assert timing.seconds == timing.d2h_s + timing.h2d_s


def test_a_failed_job_demotes_the_decisions_of_that_device_only(caplog):
    saved = fast_path.CHOICE
    fast_path.CHOICE = choice = fast_path.FastPathChoice()
    try:
        good = choice.get(("cuda:0", (4096,)), [("memmove", Memmove)], host_check)
        other = choice.get(("cuda:1", (4096,)), [("memmove", Memmove)], host_check)
        with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
            fast_path.demote_cuda("cuda:0", good, "error 700")
        decisions = choice.decisions()
        assert decisions[("cuda:0", (4096,))].chosen is None
        assert decisions[("cuda:1", (4096,))].chosen is other
        assert "memmove failed a job (error 700)" in decisions[("cuda:0", (4096,))].failures[0]
        assert len(caplog.records) == 1
    finally:
        fast_path.CHOICE = saved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_every_mechanism_is_timed_and_the_fastest_taken():
    fast_path.CHOICE.forget()
    try:
        chosen = fast_path.cuda_fast_path("cuda:0", (65536,))
        decision = fast_path.CHOICE.decisions()[("cuda:0", (65536,))]
        assert chosen is decision.chosen is not None
        assert len(decision.timings) >= 2, decision.failures  # at least the batch call and the loop
        assert chosen.name == pick([(name, t) for name, t in decision.timings])
    finally:
        fast_path.CHOICE.forget()


def test_config_check_env_names_no_mechanism_without_a_gpu(tmp_path, capsys, monkeypatch):
    """`kvtier config check --env` on a CPU tier, here: says there is nothing to choose, without
    importing torch (no GPU device nodes)."""
    from kvtier.cli.main import main
    from kvtier.tiers.file import fileio

    monkeypatch.setattr(fileio, "gpu_present", lambda: False)
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 32KiB}\n")
    assert main(["config", "check", str(path), "--env", "--block-bytes", "4KiB"]) == 0
    out = capsys.readouterr().out
    assert "tiers[0] cpu: capacity 32KiB fits; engine<->CPU: no NVIDIA GPU visible here" in out


def test_the_config_check_note_names_the_choice_and_its_figures(monkeypatch):
    """With a GPU: one decision per probe page size, each with every timed candidate's figures."""
    choice = fast_path.FastPathChoice()
    monkeypatch.setattr(fast_path, "CHOICE", choice)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seconds = {"batch": 0.002, "loop": 0.001}

    def measured(device, pages):
        return choice.get((device, pages), [("batch", named("batch")), ("loop", named("loop"))], host_check,
                          fake_timer(seconds))

    monkeypatch.setattr(fast_path, "cuda_fast_path", measured)
    note = fast_path.engine_cpu_note({}, pages=(65536, 2 << 20), gpu=True)
    assert note == ("engine<->CPU copies on cuda:0: 64 KiB pages: loop (measured here: batch: D2H 16.8 GB/s, "
                    "H2D 16.8 GB/s; loop: D2H 33.6 GB/s, H2D 33.6 GB/s); 2048 KiB pages: loop (measured here: "
                    "batch: D2H 16.8 GB/s, H2D 16.8 GB/s; loop: D2H 33.6 GB/s, H2D 33.6 GB/s)")
    assert "staged path" in fast_path.engine_cpu_note({"pin": "false"}, gpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch sees no CUDA device" in fast_path.engine_cpu_note({}, gpu=True)
