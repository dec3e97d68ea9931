"""A payload checksum computed with torch ops, so it runs where the bytes are (CPU or GPU).

`tensor_checksum(t)` gives the same 32-bit value for the same bytes on every device: it uses only
exact integer arithmetic (int64 sums that cannot overflow, then reductions modulo a prime), no
floating point and no device-specific kernel. A block read straight into GPU memory is verified
there, before it is reported loaded, without copying it to the host.

Definition. The payload is read as little-endian signed 32-bit words w_1..w_n (zero-padded to
a whole word; the slot header records the payload length separately). With p = 65521 (the
largest prime below 2^16):

    A = (w_1 + w_2 + ... + w_n) mod p              (mod: the non-negative remainder)
    B = (1*w_1 + 2*w_2 + ... + n*w_n) mod p
    checksum = B * 2^16 + A                        (fits the slot header's 32-bit field)

It detects every single-bit flip, and swapped or shifted words; random corruption passes with
probability about 2^-32, like a CRC-32 (why, and what it costs: docs/gds.md). On the CPU it is
much slower than the CRC-32, so host reads keep the CRC and the slot header records which
checksum a slot carries (`slot_format.CHECK_CRC32` / `CHECK_TORCH`).
"""

from __future__ import annotations

import warnings
from typing import Any

PRIME = 65521
_CHUNK = 1 << 14  # words per row: row sums of w * position stay below 2^60 (no int64 overflow)


def tensor_checksum(payload: Any) -> int:
    """The checksum (module docstring) of the bytes of `payload`: a C-contiguous torch tensor of
    any dtype on any device, read as raw bytes. Same value on every device. Synchronises with the
    device (returns a Python int)."""
    return int(tensor_checksum_async(payload).item())


def tensor_checksum_async(payload: Any):
    """`tensor_checksum` as a 0-dimensional int64 tensor on the payload's device (no host sync:
    several blocks' checksums can be stacked and copied to the host at once)."""
    import torch

    if not payload.is_contiguous():
        raise ValueError("tensor_checksum needs a contiguous tensor")
    data = payload.reshape(-1).view(torch.uint8)
    row_bytes = 4 * _CHUNK
    whole = data.numel() // row_bytes * row_bytes
    parts = [data[:whole].view(torch.int32).view(-1, _CHUNK)] if whole else []
    if whole < data.numel():  # the last partial row, zero-padded (a copy of < 64 KiB)
        tail = data.new_zeros(row_bytes)
        tail[:data.numel() - whole] = data[whole:]
        parts.append(tail.view(torch.int32).view(1, _CHUNK))
    sums, weighted = zip(*(_row_sums(rows) for rows in parts)) if parts else ((), ())
    row_sum = torch.cat(sums) if parts else torch.zeros(1, dtype=torch.int64, device=data.device)
    row_weighted = torch.cat(weighted) if parts else row_sum
    # row j holds positions j*C+1 .. j*C+C: its weighted sum is row_weighted + j*C * row_sum
    row_start = torch.arange(row_sum.shape[0], dtype=torch.int64, device=data.device) * _CHUNK % PRIME
    a = row_sum.sum() % PRIME  # < 2^46 per row: no overflow below 2^17 rows (8 GiB)
    b = ((row_weighted % PRIME + row_start * (row_sum % PRIME) % PRIME) % PRIME).sum() % PRIME
    return b * 65536 + a


def _row_sums(rows):
    """(sum of each row, sum of each row weighted by position 1..C) of int32 rows, in int64
    (|sums| < 2^45 and < 2^59: exact). The int32 words are read signed, which changes nothing
    for the argument of the module docstring (a flip of bit 31 still moves a word by 2^31) and
    saves a pass over the payload."""
    import torch

    position = torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=rows.device)
    return rows.sum(dim=1, dtype=torch.int64), (rows * position).sum(dim=1)


def bytes_checksum(buffer) -> int:
    """`tensor_checksum` of a host buffer (bytes, memoryview, numpy array), without copying it."""
    import torch

    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return 0
    with warnings.catch_warnings():  # read-only buffers are only read here
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(view, dtype=torch.uint8)
    return tensor_checksum(tensor)


def measure(nbytes: int = 64 << 20, repeat: int = 5) -> dict[str, float]:
    """GB/s of `tensor_checksum` on CPU tensors and of the host payload CRC-32 on the same bytes
    (best of `repeat`): the figures docs/gds.md quotes."""
    import time

    import torch

    from kvtier.tiers.file.slot_format import payload_crc32

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    array = data.numpy()

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / 1e9

    return {"bytes": nbytes, "torch_checksum_cpu_gbps": best(lambda: tensor_checksum(data)),
            "crc32_gbps": best(lambda: payload_crc32(array)), "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    """`python -m kvtier.tiers.file.checksum [--mib N] [--repeat N]`: prints `measure()`'s figures."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvtier.tiers.file.checksum",
                                     description="GB/s of the device checksum and the host CRC-32 on CPU tensors.")
    parser.add_argument("--mib", type=int, default=64, help="MiB of random bytes to checksum (default: 64)")
    parser.add_argument("--repeat", type=int, default=5, help="runs, keeping the best (default: 5)")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be at least 1")
    print(measure(args.mib << 20, args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
