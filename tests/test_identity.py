"""Whose bytes a file tier serves (issue 13.5) and backends written to the seed's contract (13.7).

A file tier's manifest records an identity (the model, given by the user or derived by the vLLM
spec) and a layout (block geometry and, in the standalone API, each KV tensor's dtype, shape and
page). A process that opens the same root_dir with another identity or layout is refused (issue
26.3) with a `ConfigError` naming root_dir, both identities and how to reset; the old blocks stay
and serve their own model again. With `on_identity_change: reset` the old contents are dropped,
with one warning that says what differed.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    ConfigError,
    CPULoadStoreSpec,
    LookupResult,
    build_hierarchy,
    load_config_text,
    make_offload_key,
)
from kvtier.core.types import BlockStatus
from kvtier.standalone import KVTier
from kvtier.tiers.base import Backend
from kvtier.tiers.file import FileBackend

torch = pytest.importorskip("torch")

NUM_KEYS = 10
KEYS = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(NUM_KEYS)]
BLOCK_SHAPE = (2, 4, 64)  # per engine block and layer: K/V x heads x head size (1 KiB in 16-bit dtypes)


def make_kv(dtype=torch.float16, shape=BLOCK_SHAPE, seed=0, num_blocks=2 * NUM_KEYS):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn((num_blocks, *shape), generator=g).to(dtype) for _ in range(2)]
    page = tensors[0][0].numel() * tensors[0].element_size()
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                             [[CanonicalKVCacheRef(i, page) for i in range(len(tensors))]])


def config(root, fingerprint=None, reset=False):
    extra = f", fingerprint: {json.dumps(fingerprint)}" if fingerprint is not None else ""
    extra += ", on_identity_change: reset" if reset else ""
    return load_config_text(f"""
block_tokens: 16
tiers:
  - {{name: cpu, backend: cpu, capacity: 16 blocks, pin: false, cascade: on_store}}
  - {{name: nvme, backend: file, root_dir: {root}, capacity: 32 blocks, io: posix, sync_interval: 0{extra}}}
""")


def store_all(root, kv, reset=False, **open_args) -> None:
    """One process's life: store the keys (written through to the file tier), then stop."""
    with KVTier.open(config(root, open_args.pop("fingerprint", None), reset), kv, **open_args) as tier:
        assert tier.store(KEYS, list(range(NUM_KEYS)))
        tier.wait()
        assert tier.stats()["nvme"]["resident_blocks"] == NUM_KEYS


def reopen(root, kv, reset=False, **open_args) -> tuple[int, int]:
    """A later process on the same root_dir: (blocks the file tier recovered, keys it loads into
    engine blocks NUM_KEYS.. of `kv`); `reset`: erase another identity's blocks."""
    with KVTier.open(config(root, open_args.pop("fingerprint", None), reset), kv, **open_args) as tier:
        recovered = tier.stats()["nvme"]["resident_blocks"]
        loaded = tier.load(KEYS, list(range(NUM_KEYS, 2 * NUM_KEYS)))
    return recovered, loaded


def refused(root, kv, **open_args) -> str:
    """The `ConfigError` of opening `root` with another identity (the message of its one problem)."""
    with pytest.raises(ConfigError) as info:
        reopen(root, kv, **open_args)
    [(path, message)] = info.value.problems
    assert path == "tiers[1].root_dir"
    assert f"{root} holds the blocks of another model or KV layout" in message
    assert "'on_identity_change: reset'" in message and f"(kvtier clear {root} --yes)" in message
    return message


def not_ours_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers.file" and "not ours" in r.getMessage()]


# ---------------------------------------------------------------------------------------- 13.5
def test_same_model_and_layout_serves_everything_after_restart(tmp_path):
    first = make_kv(seed=1)
    store_all(tmp_path / "kv", first, model="org/model@rev1")
    second = make_kv(seed=2)
    assert reopen(tmp_path / "kv", second, model="org/model@rev1") == (NUM_KEYS, NUM_KEYS)
    for a, b in zip(first.tensors, second.tensors):  # the first process's bytes, exactly
        assert torch.equal(b.tensor[NUM_KEYS:], a.tensor[:NUM_KEYS])


# The model named in the YAML (as before this fix) or by KVTier.open's model=: either way the
# layout is derived from the KV tensors and recorded with it.
IDENTITY_GIVEN = pytest.mark.parametrize("identity", [{"fingerprint": "org/model"}, {"model": "org/model"}],
                                         ids=["yaml-fingerprint", "model-argument"])


@IDENTITY_GIVEN
def test_other_kv_dtype_of_the_same_size_is_refused_and_the_old_blocks_kept(tmp_path, caplog, identity):
    """fp16 -> bf16: same block size, same model name; the old bytes would decode as garbage, and
    erasing them would lose the fp16 engine's cache: the open is refused."""
    root = tmp_path / "kv"
    store_all(root, make_kv(torch.float16), **identity)
    message = refused(root, make_kv(torch.bfloat16), **identity)
    assert "layout: found" in message and "float16" in message and "bfloat16" in message
    assert reopen(root, make_kv(torch.float16), **identity) == (NUM_KEYS, NUM_KEYS)  # nothing was erased
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):  # erased on purpose
        assert reopen(root, make_kv(torch.bfloat16), reset=True, **identity) == (0, 0)
    [warning] = not_ours_warnings(caplog)
    assert "layout" in warning and "float16" in warning and "bfloat16" in warning and "starting empty" in warning
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["fingerprint"] == "org/model" and "torch.bfloat16[2, 4, 64]/1024" in manifest["layout"]
    # the dropped contents stay dropped: going back to fp16 finds nothing either
    assert reopen(root, make_kv(torch.float16), reset=True, **identity) == (0, 0)


@IDENTITY_GIVEN
def test_other_kv_shape_of_the_same_size_is_refused(tmp_path, identity):
    store_all(tmp_path / "kv", make_kv(shape=(2, 4, 64)), **identity)
    assert "[2, 8, 32]" in refused(tmp_path / "kv", make_kv(shape=(2, 8, 32)), **identity)
    assert reopen(tmp_path / "kv", make_kv(shape=(2, 8, 32)), reset=True, **identity) == (0, 0)


def test_other_model_with_the_same_layout_is_refused(tmp_path, caplog):
    """A fine-tune (or another revision) has the very same geometry: only the identity differs."""
    store_all(tmp_path / "kv", make_kv(), model="org/model@rev1")
    message = refused(tmp_path / "kv", make_kv(), model="org/model-finetune@rev1")
    assert "fingerprint: found 'org/model@rev1', configured 'org/model-finetune@rev1'" in message
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        assert reopen(tmp_path / "kv", make_kv(), reset=True, model="org/model-finetune@rev1") == (0, 0)
    [warning] = not_ours_warnings(caplog)
    assert "fingerprint: found 'org/model@rev1', configured 'org/model-finetune@rev1'" in warning


def test_another_capacity_still_starts_empty_with_a_warning(tmp_path, caplog):
    """Not an identity change: the same model's tier resized is rebuilt, as before (one warning)."""
    store_all(tmp_path / "kv", make_kv(), model="org/model@rev1")
    bigger = config(tmp_path / "kv").tiers[1].options
    cfg = load_config_text(f"""
block_tokens: 16
tiers:
  - {{name: cpu, backend: cpu, capacity: 16 blocks, pin: false}}
  - {{name: nvme, backend: file, root_dir: {bigger['root_dir']}, capacity: 48 blocks, io: posix}}
""")
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.file"):
        with KVTier.open(cfg, make_kv(), model="org/model@rev1") as tier:
            assert tier.stats()["nvme"]["resident_blocks"] == 0
    [warning] = not_ours_warnings(caplog)
    assert "num_slots: found 32, configured 48" in warning


def test_config_fingerprint_is_an_identity_and_adds_to_model(tmp_path):
    root = tmp_path / "kv"
    store_all(root, make_kv(), fingerprint="weights-v1")  # the YAML alone names the model
    assert reopen(root, make_kv(), fingerprint="weights-v1") == (NUM_KEYS, NUM_KEYS)
    assert "found 'weights-v1', configured 'weights-v2'" in refused(root, make_kv(), fingerprint="weights-v2")
    store_all(root, make_kv(), fingerprint="weights-v2", model="org/model", reset=True)
    assert json.loads((root / "manifest.json").read_text())["fingerprint"] == "weights-v2 | org/model"
    assert reopen(root, make_kv(), fingerprint="weights-v2", model="org/model") == (NUM_KEYS, NUM_KEYS)
    refused(root, make_kv(), fingerprint="weights-v2", model="org/other")


def test_on_identity_change_must_be_refuse_or_reset(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.on_identity_change: 'wipe' is not an answer"):
        load_config_text(f"tiers:\n  - {{name: cpu, backend: cpu, capacity: 4 blocks}}\n  - {{name: nvme, "
                         f"backend: file, root_dir: {tmp_path}, capacity: 8 blocks, on_identity_change: wipe}}\n")


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_open_without_model_is_refused_naming_the_field(tmp_path):
    before = shm_entries()
    with pytest.raises(ConfigError) as info:
        KVTier.open(config(tmp_path / "kv"), make_kv())
    [(path, message)] = info.value.problems
    assert path == "tiers[1].fingerprint"
    assert "no model was given" in message and "model='<model name>@<revision>'" in message
    assert not (tmp_path / "kv").exists() and shm_entries() <= before  # nothing left behind
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.fingerprint"):
        KVTier.open(config(tmp_path / "kv", fingerprint=""), make_kv(), model="")
    with pytest.raises(TypeError, match="model: NoneType None; a string naming the model"):
        KVTier.open(config(tmp_path / "kv"), make_kv(), model=None)


def test_memory_only_hierarchy_needs_no_model():
    text = "block_bytes: 4KiB\ntiers:\n  - {name: hot, backend: memory, capacity: 4 blocks}\n"
    with KVTier.open(load_config_text(text), make_kv()) as tier:
        assert tier.store(KEYS[:2], [0, 1]) and tier.lookup(KEYS[:2]) == 2


def test_build_hierarchy_without_kv_caches_needs_an_identity(tmp_path):
    cfg = config(tmp_path / "kv")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.fingerprint: empty"):
        build_hierarchy(cfg, block_bytes=4096)
    assert not (tmp_path / "kv").exists()
    with build_hierarchy(cfg, dry_run=True, block_bytes=4096) as h:  # tracks slots only: no identity needed
        assert h.manager.tiers[1].capacity == 32
    with build_hierarchy(cfg, block_bytes=4096, model="kvtier-test") as h:
        assert h.backends["nvme"].layout == "block_bytes=4096 block_tokens=16"
    manifest = json.loads((tmp_path / "kv" / "manifest.json").read_text())
    assert manifest["fingerprint"] == "kvtier-test" and manifest["layout"] == "block_bytes=4096 block_tokens=16"


def test_file_backend_refuses_an_empty_fingerprint(tmp_path):
    with pytest.raises(ConfigError, match=r"^fingerprint: empty: file tier 'disk'"):
        FileBackend("disk", 8, 4096, 16, root_dir=str(tmp_path / "kv"))
    assert not (tmp_path / "kv").exists()


def test_layout_covers_dtype_shape_pages_groups_and_chunks():
    from kvtier.control.hierarchy import describe_layout

    base = describe_layout(2048, 16, make_kv())
    assert base == ("block_bytes=2048 block_tokens=16 blocks_per_chunk=1 "
                    "tensors=2*torch.float16[2, 4, 64]/1024 groups=0-1/1024")
    assert describe_layout(2048, 16, make_kv(torch.bfloat16)) != base
    assert describe_layout(2048, 16, make_kv(shape=(4, 2, 64))) != base
    assert describe_layout(2048, 32, make_kv()) != base
    swapped = make_kv()
    swapped.group_data_refs = [list(reversed(swapped.group_data_refs[0]))]
    assert describe_layout(2048, 16, swapped).endswith("groups=1/1024+0/1024")
    from kvtier.transfer.handlers.gpu_cpu import ChunkedKVCaches

    kv = make_kv()
    chunked = ChunkedKVCaches(kv.tensors, kv.group_data_refs, 2)
    assert "blocks_per_chunk=2" in describe_layout(4096, 16, chunked)
    assert describe_layout(2048, 16) == "block_bytes=2048 block_tokens=16"


def test_vllm_identity_covers_dtype_and_arrangement_and_keeps_the_yaml_part(tmp_path):
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.integrations.vllm import KVTierOffloadingSpec

    def fingerprint(dtype="float16", layout="NHD", yaml_fingerprint=None):
        disk = {"name": "disk", "backend": "file", "root_dir": str(tmp_path / "disk"), "capacity": "16 blocks"}
        if yaml_fingerprint is not None:
            disk["fingerprint"] = yaml_fingerprint
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
            worker_kv_bytes_per_block=1024, enable_kv_cache_events=False,
            extra_config={"kvtier_config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "4 blocks"},
                                                      disk]}},
            engine_id="identity-test", model=OffloadingModelConfig(name="org/model", dtype=dtype),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=True),
            kv_cache_layout=layout)
        return KVTierOffloadingSpec(cfg).hierarchy_config.tiers[1].options["fingerprint"]

    derived = fingerprint()
    assert "model=org/model" in derived and "dtype=float16" in derived and "kv_layout=NHD" in derived
    assert fingerprint(dtype="bfloat16") != derived and fingerprint(layout="HND") != derived
    assert fingerprint(yaml_fingerprint="rev-3f2a") == f"rev-3f2a | {derived}"  # added to, never replacing


# ---------------------------------------------------------------------------------------- 13.7
class SeedStyleBackend(Backend):
    """Written to the seed's `Backend` contract: its three abstract methods and
    `get_load_store_spec`, with its own bookkeeping, and no `close`."""

    spec_type = CPULoadStoreSpec
    medium = "CPU"

    def __init__(self, name, num_blocks, block_bytes, block_size=0):
        super().__init__(name, num_blocks, block_bytes, block_size)
        self.free_ids = list(range(num_blocks))
        self.freed: list[int] = []

    def get_num_free_blocks(self):
        return len(self.free_ids)

    def allocate_blocks(self, block_hashes):
        return [BlockStatus(self.free_ids.pop()) for _ in block_hashes]

    def free(self, block):
        self.freed.append(block.block_id)
        self.free_ids.append(block.block_id)

    def get_load_store_spec(self, block_hashes, blocks):
        return CPULoadStoreSpec([b.block_id for b in blocks], tier=self.name)


def test_seed_contract_backend_without_close_works_in_a_hierarchy():
    cfg = load_config_text(f"block_bytes: 4KiB\ntiers:\n  - {{name: seed, backend: '{__name__}:SeedStyleBackend', "
                           f"capacity: 4 blocks, policy: lru}}\n")
    with build_hierarchy(cfg) as h:
        backend, manager = h.backends["seed"], h.manager
        assert isinstance(backend, SeedStyleBackend)
        out = manager.prepare_store(KEYS[:3])
        assert sorted(int(b) for b in out.store_spec.block_ids) == [1, 2, 3]  # the backend's own slots
        manager.complete_store(KEYS[:3])
        assert [manager.lookup(k) for k in KEYS[:4]] == [LookupResult.HIT] * 3 + [LookupResult.MISS]
        assert backend.get_num_free_blocks() == 1
        out = manager.prepare_store(KEYS[3:6])  # 3 more into 4 slots: the 2 oldest are evicted through free()
        manager.complete_store(KEYS[3:6])
        assert len(backend.freed) == 2 and backend.get_num_free_blocks() == 0
    backend.close()  # the default: nothing to release, idempotent
