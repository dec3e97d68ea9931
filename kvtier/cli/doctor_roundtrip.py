"""The round trip of `kvtier doctor`: store -> close -> reopen -> load on a temporary hierarchy.

A `cpu` tier (a /dev/shm region) writing through to a `file` tier in a temporary directory, around
engine tensors in CPU memory (torch): blocks of random bytes are stored, the hierarchy is closed,
a second one is opened on the same `root_dir` (the CPU tier starts empty, so every block comes
back from the file tier's slab and journal), the engine tensors are zeroed, the blocks loaded and
their bytes compared. The directory is removed afterwards, whatever happened.
"""

from __future__ import annotations

import json
import tempfile

PAGE = 16 << 10  # bytes per engine block and layer
LAYERS, BLOCKS = 2, 4
MODEL = "kvtier-doctor/random-int8"


def _config(root: str):
    """The hierarchy, its file tier in `root` (quoted: a JSON string is a YAML scalar, whatever the path holds)."""
    from kvtier.config import load_config_text

    return load_config_text(f"""
block_tokens: 16
tiers:
  - {{name: cpu, backend: cpu, capacity: {2 * BLOCKS} blocks, cascade: on_store, pin: false}}
  - {{name: disk, backend: file, capacity: {4 * BLOCKS} blocks, root_dir: {json.dumps(root)}, sync_interval: 0}}
""", "<kvtier doctor>")


def round_trip() -> str:
    """What came back, e.g. "4 blocks of 32 KiB stored, reopened, loaded, bytes identical"; raises
    `RuntimeError` saying what differed, or the error of the step that failed."""
    import torch

    from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, make_offload_key
    from kvtier.cli.inspect import human_size
    from kvtier.standalone import KVTier

    tensors = [torch.randint(-128, 128, (BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    original = [t.clone() for t in tensors]
    kv_caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                  [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    keys = [make_offload_key(b"kvtier-doctor-%08d" % i, 0) for i in range(BLOCKS)]
    blocks = list(range(BLOCKS))
    with tempfile.TemporaryDirectory(prefix="kvtier-doctor-") as tmp:
        config = _config(f"{tmp}/tier")
        with KVTier.open(config, kv_caches, model=MODEL) as tier:
            if not tier.store(keys, blocks):
                raise RuntimeError(f"store of {BLOCKS} blocks returned False")
            tier.wait()
        for t in tensors:
            t.zero_()
        with KVTier.open(config, kv_caches, model=MODEL) as tier:
            loaded = tier.load(keys, blocks)
        if loaded != BLOCKS:
            raise RuntimeError(f"after reopening, {loaded} of {BLOCKS} blocks were loaded")
        bad = [i for i in blocks if not all(torch.equal(t[i], o[i]) for t, o in zip(tensors, original))]
        if bad:
            raise RuntimeError(f"blocks {bad} came back with other bytes")
    return (f"{BLOCKS} blocks of {human_size(LAYERS * PAGE)} stored (cpu -> file), closed, reopened, loaded, "
            f"bytes identical")
