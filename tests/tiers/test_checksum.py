"""The torch payload checksum (kvtier/tiers/file/checksum.py): definition, flips, devices."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.tiers.file.checksum import PRIME, bytes_checksum, measure, tensor_checksum

torch = pytest.importorskip("torch")


def reference(data: bytes) -> int:
    """The module docstring's definition, in plain Python integers."""
    data = data + bytes(-len(data) % 4)
    words = np.frombuffer(data, dtype="<i4").astype(object)
    a = sum(int(w) for w in words) % PRIME
    b = sum((i + 1) * int(w) for i, w in enumerate(words)) % PRIME
    return b * 65536 + a


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 4096, 65536, 65536 + 7, 3 * 65536 + 1000])
def test_matches_the_definition(size):
    data = random.Random(size).randbytes(size)
    assert bytes_checksum(data) == reference(data)
    if size:
        assert tensor_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == reference(data)


def test_extreme_words_do_not_overflow():
    """All-ones and most-negative words over several rows: the int64 sums stay exact."""
    for word in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x80", b"\xff\xff\xff\x7f"):
        data = word * (3 * (1 << 14) + 5)
        assert bytes_checksum(data) == reference(data)


def test_dtype_and_shape_do_not_matter():
    t = torch.randn(64, 257, dtype=torch.float32)
    as_bytes = t.numpy().tobytes()
    assert tensor_checksum(t) == tensor_checksum(t.view(torch.uint8)) == bytes_checksum(as_bytes)
    assert tensor_checksum(t.to(torch.bfloat16)) == bytes_checksum(t.to(torch.bfloat16).view(torch.uint8).numpy())


def test_every_single_bit_flip_is_detected_exhaustively():
    data = bytearray(random.Random(1).randbytes(160))
    t = torch.frombuffer(data, dtype=torch.uint8).clone()
    good = tensor_checksum(t)
    flipped = t.repeat(len(data) * 8, 1)  # one row per bit position
    rows = torch.arange(len(data) * 8)
    flipped[rows, rows // 8] ^= (1 << (rows % 8)).to(torch.uint8)
    assert all(tensor_checksum(row) != good for row in flipped)


def test_random_single_bit_flips_in_large_blocks():
    rng = random.Random(2)
    for size in (256 << 10, (2 << 20) + 4096):
        data = bytearray(rng.randbytes(size))
        good = bytes_checksum(data)
        for _ in range(15):
            pos, bit = rng.randrange(size), rng.randrange(8)
            data[pos] ^= 1 << bit
            assert bytes_checksum(data) != good, (size, pos, bit)
            data[pos] ^= 1 << bit
        assert bytes_checksum(data) == good


def test_random_corruption_and_swaps_are_detected():
    rng = random.Random(3)
    data = bytearray(rng.randbytes(1 << 16))
    good = bytes_checksum(data)
    for _ in range(50):
        bad = bytearray(data)
        start = rng.randrange(len(bad) - 64)
        bad[start:start + 64] = rng.randbytes(64)
        assert bytes_checksum(bad) != good
    swapped = bytearray(data)
    swapped[0:4], swapped[4:8] = data[4:8], data[0:4]  # a plain sum would not see this
    assert data[0:4] != data[4:8] and bytes_checksum(swapped) != good


def test_non_contiguous_tensor_refused():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_checksum(torch.zeros(8, 8)[:, 1])


def test_measure_reports_both_rates():
    figures = measure(1 << 20, repeat=1)
    assert figures["torch_checksum_cpu_gbps"] > 0 and figures["crc32_gbps"] > 0


@pytest.mark.gpu
def test_same_value_on_cuda_as_on_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for size in (1, 4096, (8 << 20) + 3):
        t = torch.randint(0, 256, (size,), dtype=torch.uint8)
        assert tensor_checksum(t.cuda()) == tensor_checksum(t)
