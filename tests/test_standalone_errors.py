"""Hostile-input corpus of the standalone API: every bad argument gets one clear error, at the call.

Each case is an argument the old `KVTier` accepted (and then failed in the background, dropped
blocks, truncated or wrote the wrong engine block) or refused with an error that named nothing. Each
must now raise a `KVTierError` of the expected kind whose message names the argument, leave the
hierarchy untouched (no slot allocated, no job failed), and the whole corpus must run in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from test_standalone import PAGE, cpu_file, keys, make_kv

from kvtier import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    KVTierError,
    load_config_text,
    make_offload_key,
)
from kvtier.core.errors import ArgumentError, ArgumentTypeError, ClosedError
from kvtier.standalone import KVTier
from kvtier.tiers.file.backend import MAX_KEY_BYTES

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

NUM_BLOCKS = 16


@dataclass
class Case:
    name: str
    call: Callable[[Tiers], Any]
    error: type[KVTierError]
    names: str  # the message must contain this (the argument, e.g. "keys[1]")


@dataclass
class Tiers:
    """What the cases run against: an open CPU -> file hierarchy, one over two KV groups, a closed one."""

    tier: KVTier
    grouped: KVTier
    closed: KVTier
    tmp: Any


def kv_with(mutate: Callable[[list[Any]], None], groups: int = 1) -> CanonicalKVCaches:
    """`make_kv` whose tensor list `mutate` has changed (hostile KV tensors)."""
    kv = make_kv(num_blocks=NUM_BLOCKS, groups=groups)
    tensors = [t.tensor for t in kv.tensors]
    mutate(tensors)
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in tensors], kv.group_data_refs)


def open_with(tiers: Tiers, kv: CanonicalKVCaches, **options: Any) -> None:
    with KVTier.open(cpu_file(tiers.tmp / "open"), kv, **{"model": "test-model", **options}):
        pass


def inner_gaps(t: list[Any]) -> None:
    """Blocks of two rows that skip a row each: the last dimension is contiguous, the block is not."""
    t[1] = torch.zeros(NUM_BLOCKS, 4, PAGE // 2, dtype=torch.int8)[:, ::2]


def transposed(t: list[Any]) -> None:
    t[1] = torch.zeros(PAGE, NUM_BLOCKS, dtype=torch.int8).t()


K = keys(4)
LONG = b"k" * (MAX_KEY_BYTES + 1)

CASES = [
    # keys
    Case("str key", lambda c: c.tier.store([K[0], "abc"], [1, 2]), ArgumentTypeError, "keys[1]"),
    Case("int key", lambda c: c.tier.store([7], [1]), ArgumentTypeError, "keys[0]"),
    Case("None key in lookup", lambda c: c.tier.lookup([K[0], K[1], None]), ArgumentTypeError, "keys[2]"),
    Case("one bytes object as keys", lambda c: c.tier.store(K[0], [1] * len(K[0])), ArgumentTypeError, "keys"),
    Case("one str as keys", lambda c: c.tier.lookup("abc"), ArgumentTypeError, "keys"),
    Case("keys not iterable", lambda c: c.tier.store(None, []), ArgumentTypeError, "keys"),
    Case("empty key", lambda c: c.tier.store([K[0], K[1], b""], [1, 2, 3]), ArgumentError, "keys[2]"),
    Case("3-byte key (issue 36.11: a hash plus a 4-byte group index is 5 bytes or more)",
         lambda c: c.tier.store([K[0], b"abc"], [1, 2]), ArgumentError, "keys[1]"),
    Case("4-byte key in lookup (a group index, no hash)", lambda c: c.tier.lookup([K[0], bytes(4)]),
         ArgumentError, "keys[1]"),
    Case("key longer than the file tier's slot header holds",
         lambda c: c.tier.store([K[0], LONG], [1, 2]), ArgumentError, "keys[1]"),
    Case("long key in lookup", lambda c: c.tier.lookup([LONG]), ArgumentError, "keys[0]"),
    Case("duplicate key in store", lambda c: c.tier.store([K[0], K[1], K[2], K[1]], [1, 2, 3, 4]),
         ArgumentError, "keys[3]"),
    Case("duplicate key in load", lambda c: c.tier.load([K[0], K[0]], [1, 2]), ArgumentError, "keys[1]"),
    Case("key names a KV group that does not exist",
         lambda c: c.grouped.store([K[0], make_offload_key(b"h" * 16, 2)], [1, 2]), ArgumentError, "keys[1]"),
    Case("key too short to name a KV group", lambda c: c.grouped.store([b"ab"], [1]), ArgumentError, "keys[0]"),
    # engine_block_ids
    Case("fewer ids than keys", lambda c: c.tier.store(K[:3], [1, 2]), ArgumentError, "engine_block_ids"),
    Case("more ids than keys", lambda c: c.tier.load(K[:1], [1, 2]), ArgumentError, "engine_block_ids"),
    Case("id past the last engine block", lambda c: c.tier.store(K[:2], [1, NUM_BLOCKS]), ArgumentError,
         "engine_block_ids[1]"),
    Case("id far past the end in load", lambda c: c.tier.load(K[:2], [1, 10**9]), ArgumentError,
         "engine_block_ids[1]"),
    Case("negative id", lambda c: c.tier.store(K[:2], [1, -1]), ArgumentError, "engine_block_ids[1]"),
    Case("float id", lambda c: c.tier.store(K[:2], [1, 2.7]), ArgumentTypeError, "engine_block_ids[1]"),
    Case("integral float id", lambda c: c.tier.load(K[:1], [3.0]), ArgumentTypeError, "engine_block_ids[0]"),
    Case("bool id", lambda c: c.tier.store(K[:2], [2, True]), ArgumentTypeError, "engine_block_ids[1]"),
    Case("numpy bool id", lambda c: c.tier.store(K[:1], [np.True_]), ArgumentTypeError, "engine_block_ids[0]"),
    Case("str id", lambda c: c.tier.store(K[:1], ["3"]), ArgumentTypeError, "engine_block_ids[0]"),
    Case("ids as one str", lambda c: c.tier.store(K[:2], "12"), ArgumentTypeError, "engine_block_ids"),
    Case("float tensor of ids", lambda c: c.tier.store(K[:2], torch.tensor([1.0, 2.0])), ArgumentTypeError,
         "engine_block_ids[0]"),
    Case("bool tensor of ids", lambda c: c.tier.store(K[:2], torch.tensor([True, False])), ArgumentTypeError,
         "engine_block_ids[0]"),
    Case("2-D tensor of ids", lambda c: c.tier.store(K[:4], torch.tensor([[1, 2], [3, 4]])), ArgumentTypeError,
         "engine_block_ids"),
    Case("2-D numpy array of ids", lambda c: c.tier.store(K[:2], np.array([[1], [2]])), ArgumentTypeError,
         "engine_block_ids"),
    Case("two keys loaded into one engine block", lambda c: c.tier.load(K[:3], [5, 6, 5]), ArgumentError,
         "engine_block_ids[2]"),
    # a closed KVTier
    Case("store after close", lambda c: c.closed.store(K[:1], [1]), ClosedError, "closed"),
    Case("load after close", lambda c: c.closed.load(K[:1], [1]), ClosedError, "closed"),
    Case("lookup after close", lambda c: c.closed.lookup(K[:1]), ClosedError, "closed"),
    Case("wait after close", lambda c: c.closed.wait(), ClosedError, "closed"),
    # kv_caches at open
    Case("transposed KV tensor", lambda c: open_with(c, kv_with(transposed)), ArgumentError, "kv_caches.tensors[1]"),
    Case("KV tensor whose blocks have gaps", lambda c: open_with(c, kv_with(inner_gaps)), ArgumentError,
         "kv_caches.tensors[1]"),
    Case("numpy array as KV tensor", lambda c: open_with(c, kv_with(lambda t: t.__setitem__(0, t[0].numpy()))),
         ArgumentTypeError, "kv_caches.tensors[0]"),
    Case("page larger than a block",
         lambda c: open_with(c, CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(NUM_BLOCKS, PAGE // 2,
                                                                                      dtype=torch.int8), PAGE)])),
         ArgumentError, "kv_caches.tensors[0].page_size_bytes"),
    Case("no KV tensors", lambda c: open_with(c, CanonicalKVCaches([])), ArgumentError, "kv_caches.tensors"),
    Case("reference to a missing tensor",
         lambda c: open_with(c, CanonicalKVCaches(make_kv(NUM_BLOCKS).tensors,
                                                  [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(5, PAGE)]])),
         ArgumentError, "kv_caches.group_data_refs[0][1].tensor_idx"),
    Case("zero blocks per chunk", lambda c: open_with(c, make_kv(NUM_BLOCKS), blocks_per_chunk=0), ArgumentError,
         "blocks_per_chunk"),
    Case("fractional blocks per chunk", lambda c: open_with(c, make_kv(NUM_BLOCKS), blocks_per_chunk=1.5),
         ArgumentTypeError, "blocks_per_chunk"),
    Case("bool blocks per chunk", lambda c: open_with(c, make_kv(NUM_BLOCKS), blocks_per_chunk=True),
         ArgumentTypeError, "blocks_per_chunk"),
    Case("a KV-cache group with no references",
         lambda c: open_with(c, CanonicalKVCaches(make_kv(NUM_BLOCKS).tensors, [[]])), ArgumentError,
         "kv_caches.group_data_refs[0]"),
    Case("a reference's tensor index as a str",
         lambda c: open_with(c, CanonicalKVCaches(make_kv(NUM_BLOCKS).tensors, [[CanonicalKVCacheRef("0", PAGE)]])),
         ArgumentTypeError, "kv_caches.group_data_refs[0][0].tensor_idx"),
    Case("a reference's page as a float",
         lambda c: open_with(c, CanonicalKVCaches(make_kv(NUM_BLOCKS).tensors, [[CanonicalKVCacheRef(0, 100.0)]])),
         ArgumentTypeError, "kv_caches.group_data_refs[0][0].page_size_bytes"),
    Case("KV tensors on the meta device (shapes, no bytes)",
         lambda c: open_with(c, CanonicalKVCaches([CanonicalKVCacheTensor(
             torch.empty(NUM_BLOCKS, PAGE, dtype=torch.int8, device="meta"), PAGE)])), ArgumentError,
         "kv_caches.tensors[0]"),
    Case("a KV tensor of no blocks",
         lambda c: open_with(c, CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(0, PAGE, dtype=torch.int8),
                                                                          PAGE)])), ArgumentError,
         "kv_caches.tensors[0]"),
    # open's other arguments
    Case("model None", lambda c: open_with(c, make_kv(NUM_BLOCKS), model=None), ArgumentTypeError, "model"),
    Case("config None", lambda c: KVTier.open(None, make_kv(NUM_BLOCKS)), ArgumentTypeError, "config"),
    Case("a misspelt option", lambda c: open_with(c, make_kv(NUM_BLOCKS), metric_port=9400), ArgumentTypeError,
         "metric_port"),
    # timeouts
    Case("flush timeout as a str", lambda c: c.tier.flush("x"), ArgumentTypeError, "timeout"),
    Case("flush timeout NaN", lambda c: c.tier.flush(float("nan")), ArgumentError, "timeout"),
    Case("negative flush timeout", lambda c: c.tier.flush(-1), ArgumentError, "timeout"),
    Case("flush timeout past a float", lambda c: c.tier.flush(10**400), ArgumentError, "timeout"),
    Case("close's flush timeout as a str (the tier stays open)", lambda c: c.tier.close(flush_timeout="x"),
         ArgumentTypeError, "flush_timeout"),
    # hints
    Case("a hint without retain_s", lambda c: c.tier.store(K[:1], [1], hints={"session": "s"}), ArgumentError,
         "hints.retain_s"),
    Case("a hint's 5,000-digit retain_s", lambda c: c.tier.store(K[:1], [1], hints={"session": "s",
                                                                                    "retain_s": 10**5000}),
         ArgumentError, "hints.retain_s"),
]


def run_case(case: Case, tiers: Tiers) -> str | None:
    """None when `case` raised the right error naming its argument, else what went wrong."""
    try:
        result = case.call(tiers)
    except case.error as exc:
        message = str(exc)
        if case.names not in message:
            return f"{case.name}: message does not name {case.names!r}: {message}"
        if len(message) > 400:
            return f"{case.name}: message of {len(message)} characters"
        return None
    except Exception as exc:  # noqa: BLE001 - the corpus reports every wrong kind of error
        return f"{case.name}: {type(exc).__name__} instead of {case.error.__name__}: {str(exc)[:200]}"
    return f"{case.name}: accepted (returned {result!r}) instead of raising {case.error.__name__}"


def test_every_hostile_argument_gets_a_clear_error(tmp_path):
    started = time.perf_counter()
    grouped_kv = make_kv(num_blocks=NUM_BLOCKS, groups=2)
    with KVTier.open(cpu_file(tmp_path), make_kv(num_blocks=NUM_BLOCKS), model="test-model") as tier, \
            KVTier.open(cpu_file(tmp_path / "g"), grouped_kv, model="test-model") as grouped:
        closed = KVTier.open(cpu_file(tmp_path / "c"), make_kv(num_blocks=NUM_BLOCKS), model="test-model")
        closed.close()
        tiers = Tiers(tier, grouped, closed, tmp_path)
        problems = [p for p in (run_case(case, tiers) for case in CASES) if p]
        elapsed = time.perf_counter() - started
        assert not problems, f"{len(problems)} of {len(CASES)} cases:\n" + "\n".join(problems)
        # Nothing was accepted: no slot taken, no job failed, and the tier still works.
        tier.wait()
        for stats in (tier.stats(), grouped.stats()):
            assert all(s["stores"] == 0 and s["failures"] == 0 for name, s in stats.items() if name != "engine")
            assert stats["engine"]["store_failures"] == stats["engine"]["load_failures"] == 0
        for kvtier in (tier, grouped):
            assert all(t.backend.get_num_free_blocks() == t.backend.num_blocks for t in kvtier.manager.tiers)
        assert tier.store(K, [1, 2, 3, 4]) and tier.load(K, [5, 6, 7, 8]) == 4
    assert not (tmp_path / "open").exists()  # a refused open builds nothing
    assert elapsed < 5.0, f"the corpus of {len(CASES)} cases took {elapsed:.2f} s"


def test_every_error_is_a_kvtier_error_and_a_builtin_one():
    """Callers can catch what they expect from Python (ValueError, TypeError, RuntimeError) or KVTierError."""
    assert issubclass(ArgumentError, KVTierError) and issubclass(ArgumentError, ValueError)
    assert issubclass(ArgumentTypeError, ArgumentError) and issubclass(ArgumentTypeError, TypeError)
    assert issubclass(ClosedError, KVTierError) and issubclass(ClosedError, RuntimeError)


def test_a_key_shorter_than_a_hash_and_a_group_index_says_so(tmp_path):
    with KVTier.open(load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks, pin: false}\n"),
                     make_kv()) as tier:
        with pytest.raises(ArgumentError, match=r"^keys\[1\]: key of 3 bytes is shorter than 5: a key is a block hash "
                                                r"\(1 byte or more\) plus a 4-byte group index"):
            tier.store([K[0], b"abc"], [1, 2])
