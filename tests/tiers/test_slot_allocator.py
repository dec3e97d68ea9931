"""SlotAllocator: distinct slots, freed slots reused first (most recently freed first), then fresh ones."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.base import SlotAllocator


def test_fresh_slots_in_order_then_freed_ones_newest_first():
    slots = SlotAllocator(8)
    assert slots.allocate(3) == [0, 1, 2]
    slots.release_many([1, 0])
    slots.release(2)
    assert slots.num_free == 8
    assert slots.allocate(5) == [2, 0, 1, 3, 4]
    assert slots.allocate(0) == []
    assert slots.num_free == 3


def test_asking_for_more_than_free_raises_and_changes_nothing():
    slots = SlotAllocator(4)
    slots.allocate(3)
    with pytest.raises(RuntimeError, match="asked for 2 slots, only 1 free"):
        slots.allocate(2)
    assert slots.allocate(1) == [3]


def test_matches_a_pop_one_at_a_time_model():
    """Random allocate/release sequences: same slots as popping the free list one by one."""
    for seed in range(200):
        rng = random.Random(seed)
        slots, free, fresh, held = SlotAllocator(40), [], 0, []
        for _ in range(40):
            if held and rng.random() < 0.4:
                rng.shuffle(held)
                k = rng.randint(1, len(held))
                released, held = held[:k], held[k:]
                slots.release_many(released)
                free.extend(released)
                continue
            n = rng.randint(0, slots.num_free)
            expected = [free.pop() for _ in range(min(n, len(free)))]
            new = n - len(expected)
            expected += range(fresh, fresh + new)
            fresh += new
            got = slots.allocate(n)
            assert got == expected
            assert len(set(held) | set(got)) == len(held) + len(got)
            held += got
