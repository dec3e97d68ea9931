"""`kvtier bench hops` end to end: repeated, byte-verified rows with spread and flags, scattered
CPU slots, and the directory and filesystem it measured named in the output and the JSON."""

from __future__ import annotations

import json
import os
import statistics

from kvtier.cli.main import main

MEMORY = "configs/memory.yaml"


def test_hops_repeat_verify_and_name_what_they_measured(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "hops", "--config", MEMORY, "--quick", "--block-sizes", "64KiB", "--repeats", "2",
            "--root-dir", str(tmp_path), "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out
    doc = json.loads(out.read_text())
    assert (captured.out + captured.err).count("file hops measured in") == 1  # issue 36.12: it was thrice
    assert doc["schema"] == "kvtier.bench/2"
    place = doc["file_hops_dir"]
    assert place["parent"] == os.path.realpath(tmp_path) and place["reason"].startswith("given by --root-dir")
    assert place["fstype"] and place["mount_point"] and os.path.realpath(tmp_path).startswith(place["mount_point"])
    assert f"file hops measured in {place['parent']} ({place['fstype']} on " in text
    hops = {(r["hop"], r.get("slots") or r.get("path")) for r in doc["hops"]}
    assert {("GPU->CPU", "consecutive"), ("GPU->CPU", "scattered"), ("CPU->GPU", "consecutive"),
            ("CPU->GPU", "scattered"), ("CPU->FILE", None), ("FILE->CPU", None), ("GPU->FILE", "staged"),
            ("FILE->GPU", "staged")} <= hops
    assert "engine<->FILE direct (kvikio) not measured: it serves a KV cache on CUDA" in text
    for row in doc["hops"]:
        assert row["verified"] is True and row["repeats"] == 2
        assert len(row["samples_gbps"]) == 2 and len(row["baseline_samples_gbps"]) == 2
        assert abs(row["gbps"] - statistics.median(row["samples_gbps"])) < 1e-9
        assert abs(row["ratio"] - row["gbps"] / row["baseline_gbps"]) < 1e-9
        assert row["spread"] >= 0 and row["baseline_spread"] >= 0 and isinstance(row["flags"], list)
    assert "engine->CPU scattered" in text
    engine_rows = [r for r in doc["hops"] if r["hop"] in ("GPU->CPU", "CPU->GPU")]
    for hop in ("GPU->CPU", "CPU->GPU"):  # every row of a direction measured the same baseline copy
        assert len({r["baseline_key"] for r in engine_rows if r["hop"] == hop}) == 1
    assert any(line.split() == ["hop", "block", "kvtier", "GB/s", "spread", "baseline", "GB/s", "spread", "ratio",
                                "flags"] for line in text.splitlines())
    assert not [p for p in tmp_path.iterdir() if p.name != "bench.json"]  # the work directory is removed
