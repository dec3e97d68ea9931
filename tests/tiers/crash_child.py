"""Child process of test_file_crash.py: a store storm on a file tier until it is killed.

Usage: crash_child.py ROOT SEED NUM_BLOCKS BLOCK_BYTES
Just before each write_blocks it prints `B <slots> <ids>`; after it returns (durable) it prints `C`.
Block `id` has key `id_key(id)` and payload `id_payload(id, block_bytes)`.
"""

from __future__ import annotations

import hashlib
import random
import sys

from kvtier.core.types import BlockStatus
from kvtier.tiers.file import FileBackend


def id_key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4 + b"\0\0\0\0"


def key_id(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def id_payload(i: int, block_bytes: int) -> bytes:
    return hashlib.shake_128(id_key(i)).digest(block_bytes)


def main() -> None:
    root, seed, num_blocks, block_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    backend = FileBackend("crash", num_blocks, block_bytes, 16, root_dir=root, io="posix", num_threads=2,
                          fingerprint="crash-test")
    occupied = {block.block_id for _, block in backend.recover()}
    next_id = seed * 1_000_000
    while True:
        if rng.random() < 0.7:  # a run of adjacent slots (one coalesced I/O) ...
            start = rng.randrange(num_blocks)
            slots = list(range(start, min(num_blocks, start + rng.randint(1, 4))))
        else:  # ... or scattered slots (several I/Os in parallel)
            slots = rng.sample(range(num_blocks), rng.randint(2, 6))
        ids = list(range(next_id, next_id + len(slots)))
        next_id += len(slots)
        for slot in slots:
            if slot in occupied:
                backend.free(BlockStatus(slot))
        keys, payloads = [id_key(i) for i in ids], [id_payload(i, block_bytes) for i in ids]
        print("B", ",".join(map(str, slots)), ",".join(map(str, ids)), flush=True)
        backend.write_blocks(slots, keys, payloads)
        occupied.update(slots)
        print("C", flush=True)


if __name__ == "__main__":
    main()
