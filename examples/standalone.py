"""Standalone use of kvtier: a CPU tier in front of a file tier, around KV tensors in CPU memory.

Run: python examples/standalone.py
Stores 24 blocks into a CPU tier that holds 8 (the rest cascade to the file tier), wipes the
"engine" KV cache, loads everything back and checks the bytes.
"""

import tempfile

import torch

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, load_config_text, make_offload_key
from kvtier.standalone import KVTier

PAGE = 16 << 10  # bytes per engine block and layer
NUM_LAYERS, NUM_ENGINE_BLOCKS, NUM_KEYS = 2, 32, 24


def main() -> None:
    tensors = [torch.randint(-128, 128, (NUM_ENGINE_BLOCKS, PAGE), dtype=torch.int8) for _ in range(NUM_LAYERS)]
    kv_caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                  [[CanonicalKVCacheRef(i, PAGE) for i in range(NUM_LAYERS)]])
    original = [t.clone() for t in tensors]
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(NUM_KEYS)]
    engine_blocks = list(range(NUM_KEYS))

    with tempfile.TemporaryDirectory() as root:
        config = load_config_text(f"""
block_tokens: 16
tiers:
  - name: cpu
    backend: cpu
    capacity: 8 blocks
    policy: lru
  - name: nvme
    backend: file
    root_dir: {root}
    capacity: 64 blocks
    policy: lru
""")
        with KVTier.open(config, kv_caches, model="kvtier-example/random-int8") as tier:
            for start in range(0, NUM_KEYS, 4):  # store in small batches, as an engine would
                assert tier.store(keys[start:start + 4], engine_blocks[start:start + 4])
            tier.wait()
            for t in tensors:
                t.zero_()
            loaded = tier.load(keys, engine_blocks)
            same = all(torch.equal(a[:NUM_KEYS], b[:NUM_KEYS]) for a, b in zip(tensors, original))
            print(f"loaded {loaded}/{NUM_KEYS} blocks, bytes identical: {same}")
            for name, s in tier.stats().items():
                print(name, s)


if __name__ == "__main__":
    main()
