"""`BackendTests`' slot bookkeeping group: free counts, allocation, reuse, no slot shared."""

from __future__ import annotations

from kvtier.core.types import BlockStatus
from kvtier.testing import backend_contract as contract
from kvtier.testing.backend_harness import BackendHarness, keys
from kvtier.testing.clauses import call


class SlotTests(BackendHarness):
    """Slot bookkeeping (`get_num_free_blocks`, `allocate_blocks`, `free`, `free_many`)."""

    # ------------------------------------------------------------------ slots
    def test_starts_with_every_slot_free(self):
        self.assert_free(self.backend(), self.num_blocks, contract.STARTS_FREE)

    def test_allocate_and_free_move_the_free_count(self):
        backend = self.backend()
        first = self.allocate(backend, range(3))
        second = self.allocate(backend, range(3, 5))
        call(contract.FREE, "free(block)", backend.free, first[1])
        self.assert_free(backend, self.num_blocks - 4, contract.FREE)
        call(contract.FREE, "free_many(4 blocks)", backend.free_many, [first[0], first[2], *second])
        self.assert_free(backend, self.num_blocks, contract.FREE)

    def test_new_blocks_are_being_written(self):
        backend = self.backend()
        got = [b.ref_cnt for b in self.allocate(backend, range(3))]
        assert got == [-1, -1, -1], f"{contract.BEING_WRITTEN}: ref_cnt {got}"

    def test_allocate_nothing(self):
        backend = self.backend()
        got = self.allocate(backend, [])
        assert got == [], f"{contract.ALLOCATE}: allocate_blocks([]) returned {got!r}"

    def test_no_slot_handed_out_twice_while_allocated(self):
        backend = self.backend()
        held = self.allocate(backend, range(self.num_blocks // 2))
        held += self.allocate(backend, range(100, 100 + self.num_blocks - len(held)))
        slots = [b.block_id for b in held]
        assert len(set(slots)) == self.num_blocks, f"{contract.UNIQUE_SLOTS}: slots handed out twice: {sorted(slots)}"
        assert all(0 <= s < self.num_blocks for s in slots), f"{contract.UNIQUE_SLOTS}: got {slots}"
        self.assert_free(backend, 0, contract.ALLOCATE)

    def test_never_over_allocates(self):
        backend = self.backend()
        self.allocate(backend, range(self.num_blocks))
        self.assert_free(backend, 0, contract.ALLOCATE)
        try:
            extra = backend.allocate_blocks(keys([999]))
        except Exception:  # noqa: BLE001 - refusing loudly is allowed (callers check first)
            extra = None
        assert not extra, f"{contract.NO_OVERALLOCATION}: handed out {extra} with no slot free"
        self.assert_free(backend, 0, contract.NO_OVERALLOCATION)

    def test_freed_slots_are_reused_and_never_shared(self):
        backend = self.backend()
        blocks = self.allocate(backend, range(self.num_blocks))
        freed = blocks[1::2]
        kept = blocks[0::2]
        backend.free_many(freed)
        again = self.allocate(backend, range(200, 200 + len(freed)))
        assert {b.block_id for b in again} == {b.block_id for b in freed}, \
            f"{contract.REUSE}: freed {sorted(b.block_id for b in freed)}, got {sorted(b.block_id for b in again)}"
        assert not {b.block_id for b in again} & {b.block_id for b in kept}, f"{contract.REUSE}: a held slot again"
        self.assert_free(backend, 0, contract.ALLOCATE)

    def test_churn_keeps_slots_unique(self):
        """Allocate and free in a fixed interleaving: the held slots are always distinct, the
        free count always equals capacity minus held."""
        backend = self.backend()
        held: list[BlockStatus] = []
        step = 0
        for round_ in range(6):
            want = min(backend.get_num_free_blocks(), 1 + round_ % 3)
            held += self.allocate(backend, range(step, step + want))
            step += want
            slots = [b.block_id for b in held]
            assert len(set(slots)) == len(slots), f"{contract.UNIQUE_SLOTS}: slot held twice: {sorted(slots)}"
            self.assert_free(backend, self.num_blocks - len(held), contract.ALLOCATE)
            for b in held[::2]:
                backend.free(b)
            held = held[1::2]
            self.assert_free(backend, self.num_blocks - len(held), contract.FREE)
