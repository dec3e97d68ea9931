"""`kvtier bench hops --block-sizes` over its whole documented range (1 B to 1 GiB): every size is
measured with a bounded number of blocks, 4 KiB blocks never ask one pwritev for more than IOV_MAX
iovecs, and sizes that are not whole pages release their aligned buffer cleanly."""

from __future__ import annotations

import json
import os

import pytest

from kvtier.bench import hops
from kvtier.bench.file_hops import io_views, iov_max, raw_direct
from kvtier.bench.hops_runner import capped_note
from kvtier.cli.main import main
from kvtier.tiers.file.fileio import aligned_buffer


def test_the_blocks_of_one_measurement_are_bounded_whatever_the_block_size():
    assert hops.hop_blocks(1, 128 << 20) == hops.MAX_HOP_BLOCKS  # was 134,217,728 one-byte blocks
    assert hops.hop_blocks(1, 1 << 30, least=2) == hops.MAX_HOP_BLOCKS
    assert hops.hop_blocks(64 << 10, 16 << 20) == 256  # the usual sizes keep their share of bytes
    assert hops.hop_blocks(1 << 30, 16 << 20, least=8) == 8
    assert capped_note([1, 64 << 10], 16 << 20)[0].startswith(f"block sizes 1B: each hop moves at most "
                                                              f"{hops.MAX_HOP_BLOCKS:,} blocks")
    assert capped_note([64 << 10], 16 << 20) == []


@pytest.fixture
def buffered(monkeypatch):
    """The raw baseline's I/O without O_DIRECT (tmp_path may be a tmpfs): the same iovecs."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)


def _views(count: int, block_bytes: int) -> tuple[object, list[memoryview]]:
    region = aligned_buffer(count * block_bytes)
    whole = memoryview(region)
    return region, [whole[i * block_bytes:(i + 1) * block_bytes] for i in range(count)]


def test_page_blocks_are_written_in_ios_of_at_most_iov_max_iovecs(tmp_path, buffered):
    count = 2 * iov_max() + 5  # 8 MiB of 4 KiB blocks was one pwritev of 2048 iovecs: EINVAL
    _src_region, sources = _views(count, 4096)
    _dst_region, dests = _views(count, 4096)
    for i, view in enumerate(sources):
        view[:] = (i % 251).to_bytes(1, "big") * 4096
    ios, release = io_views(sources, 4096)
    assert all(len(io) <= iov_max() for io in ios) and sum(len(io) for io in ios) == count
    release()
    raw_direct(tmp_path / "raw", sources, dests, 4096, threads=2)
    assert all(d == s for d, s in zip(dests, sources))  # read back into the destinations


@pytest.mark.parametrize("block_bytes", [1, 100_000])
def test_blocks_of_partial_pages_release_their_buffer(tmp_path, buffered, block_bytes):
    _src_region, sources = _views(40, block_bytes)
    _dst_region, dests = _views(40, block_bytes)
    seconds = raw_direct(tmp_path / "raw", sources, dests, block_bytes, threads=2)  # was BufferError
    assert len(seconds) == 3 and all(s >= 0 for s in seconds)
    assert (tmp_path / "raw").stat().st_size >= 40 * block_bytes


def test_one_byte_blocks_run_end_to_end_with_bounded_blocks(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(hops, "MAX_HOP_BLOCKS", 64)  # the bound itself: small, so that this is quick
    out = tmp_path / "bench.json"
    argv = ["bench", "hops", "--config", "configs/memory.yaml", "--quick", "--block-sizes", "1B",
            "--repeats", "1", "--root-dir", str(tmp_path), "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "block sizes 1B: each hop moves at most 64 blocks to keep memory bounded" in text
    rows = json.loads(out.read_text())["hops"]
    tiny = [r for r in rows if r["block_bytes"] == 1]
    assert {r["hop"] for r in tiny} >= {"GPU->CPU", "CPU->GPU", "CPU->FILE", "FILE->CPU"}
    for row in tiny:
        assert row["verified"] is True
        assert row.get("blocks", 0) <= 64 and row.get("total_bytes", row.get("bytes")) <= 64
