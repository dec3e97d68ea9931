"""The store threshold's table of offers is bounded in bytes, not only in keys (issue 36.6).

On 7e6c7c1 it held every offered key itself: 64,000 one-time keys of 65,532 bytes (the longest a
compiled index holds) grew RSS by 1.25 GiB at 20,000 keys, heading for ~4 GiB. It now keeps a
16-byte digest of each key, about `ENTRY_BYTES` per entry whatever the key's length, and counts
offers exactly as before (vLLM's semantics, checked offer by offer in
tests/integration/test_vllm_store_threshold.py)."""

from __future__ import annotations

import tracemalloc

from kvtier.control.store_threshold import ENTRY_BYTES, StoreThreshold

LONG = 65_532


def long_keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * (LONG // 8) for i in range(start, start + n)]


def test_the_table_costs_about_entry_bytes_per_key_whatever_the_keys_length():
    tracker = StoreThreshold(2, max_tracker_size=4000)
    tracemalloc.start()
    try:
        for start in range(0, 6000, 100):  # more one-time keys than the table holds
            batch = long_keys(start, 100)
            tracker.admit(batch, set(batch))
        del batch
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(tracker.counts or ()) == 4000
    assert held < 4000 * ENTRY_BYTES * 1.5, f"{held / 4000:.0f} bytes per entry"  # 7e6c7c1: ~65,600


def test_counts_follow_the_keys_not_their_digests():
    tracker = StoreThreshold(3, max_tracker_size=2)
    a, b, c = long_keys(0, 3)
    assert tracker.admit([a], {a}) == [] and tracker.count(a) == 1
    assert tracker.admit([a, b], {a, b}) == [] and (tracker.count(a), tracker.count(b)) == (2, 1)
    assert tracker.admit([a], {a}) == [a] and tracker.count(a) == 3
    assert tracker.admit([c], {c}) == [] and tracker.count(b) == 0  # b was the least recently offered
    assert tracker.skipped == 4
