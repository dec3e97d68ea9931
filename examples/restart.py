"""The README's standalone snippet, then a restart: every block is found again.

Run: python examples/restart.py [ROOT_DIR]
Uses the shipped default hierarchy (configs/cpu-file.yaml: a CPU tier, cascade on_evict, over a
file tier) sized to this example: 64 blocks of 128 KiB in each tier instead of the shipped 1 GiB and
4 GiB (a file tier preallocates its whole slab: 4 GiB on disk for 5 MiB of blocks otherwise), with
its file tier in ROOT_DIR (default: a temporary directory, removed at the end). A first process
stores 40 blocks in one call (they all fit in the CPU tier, so none has been written below yet) and
closes: `close()` flushes them to the file tier. A second process opens the same root_dir and loads
the 40 into other engine blocks, checking every byte.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from kvtier import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, make_offload_key, parse_config
from kvtier.standalone import KVTier

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu-file.yaml"
PAGE, NUM_LAYERS, NUM_KEYS = 64 << 10, 2, 40
TIER_BLOCKS = 64  # each tier's capacity: room for the 40 blocks, a slab of ~8 MiB
MODEL = "kvtier-example/random-int8@1"


def kv_caches() -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """KV tensors of 2 layers x 80 engine blocks; the first 40 blocks hold a fixed random pattern."""
    g = torch.Generator().manual_seed(40)
    tensors = [torch.zeros((2 * NUM_KEYS, PAGE), dtype=torch.int8) for _ in range(NUM_LAYERS)]
    for t in tensors:
        t[:NUM_KEYS] = torch.randint(-128, 128, (NUM_KEYS, PAGE), dtype=torch.int8, generator=g)
    refs = [[CanonicalKVCacheRef(i, PAGE) for i in range(NUM_LAYERS)]]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs), tensors


def config(root: str):
    """configs/cpu-file.yaml with its tiers sized to this example and its file tier in `root`."""
    raw = yaml.safe_load(CONFIG.read_text())
    cpu, nvme = raw["tiers"]
    cpu["capacity"] = nvme["capacity"] = f"{TIER_BLOCKS} blocks"
    nvme["root_dir"] = root
    return parse_config(raw, str(CONFIG))


def phase(name: str, root: str) -> None:
    kv, tensors = kv_caches()
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(NUM_KEYS)]
    with KVTier.open(config(root), kv, model=MODEL) as tier:
        if name == "store":
            assert tier.store(keys, list(range(NUM_KEYS)))
            print(f"store: 40 blocks stored; file tier holds {tier.stats()['nvme']['resident_blocks']} before close")
            return
        found = tier.stats()["nvme"]["resident_blocks"]
        loaded = tier.load(keys, list(range(NUM_KEYS, 2 * NUM_KEYS)))
        same = all(torch.equal(t[NUM_KEYS:], t[:NUM_KEYS]) for t in tensors)
        print(f"restart: file tier recovered {found} blocks; loaded {loaded}/{NUM_KEYS}, bytes identical: {same}")
        if loaded != NUM_KEYS or not same:
            sys.exit(1)


def main() -> None:
    if len(sys.argv) == 3:  # a child process: python restart.py store|load ROOT
        phase(sys.argv[1], sys.argv[2])
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = sys.argv[1] if len(sys.argv) > 1 else str(Path(tmp) / "nvme")
        for name in ("store", "load"):  # two processes: the second is a restart
            subprocess.run([sys.executable, __file__, name, root], check=True)


if __name__ == "__main__":
    main()
