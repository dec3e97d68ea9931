"""`BackendTests`: the `Backend` contract as a pytest suite a third-party backend subclasses.

    # test_my_backend.py
    from kvtier.testing.backend import BackendTests
    from my_package import MyBackend

    class TestMyBackend(BackendTests):
        def make_backend(self, num_blocks, block_bytes):
            return MyBackend("t", num_blocks, block_bytes, 16)

        # only if MyBackend.persistent is True: the same storage opened again, same identity
        def reopen(self, backend):
            return MyBackend("t", backend.num_blocks, backend.block_bytes, 16)

Checked: slot bookkeeping (`get_num_free_blocks`, `allocate_blocks`, `free`, `free_many`: counts
move by exactly the blocks allocated or freed, nothing over-allocated, no slot handed out twice
while allocated, freed slots reusable), `get_load_store_spec` (the backend's `spec_type`, the
blocks' slots in the order given), `close` (twice is fine), `still_valid` (a bool, changes
nothing), `recover` (nothing unless persistent) and, when `persistent` is declared, that blocks
written through the backend's byte API come back after `close` and `reopen`.

Bytes are moved by `write_bytes`/`read_bytes`. Their defaults know kvtier's two byte APIs: block
files (`write_blocks`/`read_blocks`, as `FileBackend`) and host-addressable slots (`view(slot)`,
as `MemoryBackend` and `CPUBackend`); override them for any other kind.

Every failure message starts with the contract clause it enforces
(`kvtier.testing.backend_contract.BACKEND_CLAUSES`, listed in the README).

Needs pytest only; uses no fixture and no conftest of the kvtier repository. Each test closes
what it builds (call `self.track(backend)` for backends a test makes itself).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from kvtier.keys import OffloadKey, make_offload_key
from kvtier.specs import BlockIDsLoadStoreSpec
from kvtier.testing import backend_contract as contract
from kvtier.testing.clauses import call
from kvtier.tiers.base import Backend
from kvtier.types import BlockStatus

__all__ = ["BackendTests"]


def key(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), i % 3)


def payload(i: int, size: int) -> bytes:
    """Distinct, reproducible bytes for block `i`."""
    return hashlib.shake_128(str(i).encode()).digest(size)


def keys(ids: range | Sequence[int]) -> list[OffloadKey]:
    return [key(i) for i in ids]


class BackendTests:
    """Subclass as `class TestMine(BackendTests)` and implement `make_backend`; persistent
    backends also implement `reopen`. `num_blocks`/`block_bytes` are the geometry the tests use
    (a backend with a minimum block size raises them in the subclass)."""

    num_blocks: int = 8
    block_bytes: int = 4096

    # ------------------------------------------------------------------ hooks
    def make_backend(self, num_blocks: int, block_bytes: int) -> Backend:
        """A fresh, empty backend of `num_blocks` slots of `block_bytes`."""
        raise NotImplementedError(f"{type(self).__name__}: implement make_backend(num_blocks, block_bytes)")

    def reopen(self, backend: Backend) -> Backend:
        """The storage of the closed `backend` opened again with the same identity (persistent
        backends only)."""
        raise NotImplementedError(f"{type(self).__name__}: {type(backend).__name__} declares persistent = True; "
                                  f"implement reopen(backend) to test that its blocks survive a restart")

    def write_bytes(self, backend: Backend, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus],
                    data: Sequence[bytes]) -> None:
        """Store `data[i]` as block `keys[i]` in the slot of `blocks[i]`."""
        if hasattr(backend, "write_blocks"):
            backend.write_blocks([b.block_id for b in blocks], list(keys), list(data))
        elif hasattr(backend, "view"):
            for block, chunk in zip(blocks, data):
                backend.view(block.block_id)[:] = chunk
        else:
            raise NotImplementedError(f"{type(self).__name__}: override write_bytes for {type(backend).__name__}")

    def read_bytes(self, backend: Backend, keys: Sequence[OffloadKey], blocks: Sequence[BlockStatus]) -> list[bytes]:
        """The bytes of blocks `keys[i]` in the slots of `blocks[i]`."""
        if hasattr(backend, "read_blocks"):
            out = [bytearray(backend.block_bytes) for _ in blocks]
            backend.read_blocks([b.block_id for b in blocks], list(keys), out)
            return [bytes(o) for o in out]
        if hasattr(backend, "view"):
            return [bytes(backend.view(b.block_id)) for b in blocks]
        raise NotImplementedError(f"{type(self).__name__}: override read_bytes for {type(backend).__name__}")

    # ------------------------------------------------------------------ helpers
    def track(self, backend: Backend) -> Backend:
        """Close `backend` at the end of the test (see `teardown_method`)."""
        self.__dict__.setdefault("_open_backends", []).append(backend)
        return backend

    def backend(self) -> Backend:
        return self.track(self.make_backend(self.num_blocks, self.block_bytes))

    def teardown_method(self, method=None) -> None:
        for backend in reversed(self.__dict__.pop("_open_backends", [])):
            backend.close()

    def allocate(self, backend: Backend, ids: Sequence[int]) -> list[BlockStatus]:
        free = backend.get_num_free_blocks()
        blocks = call(contract.ALLOCATE, f"allocate_blocks({len(ids)} keys)", backend.allocate_blocks, keys(ids))
        assert len(blocks) == len(ids), f"{contract.ALLOCATE}: asked for {len(ids)} blocks, got {len(blocks)}"
        assert all(isinstance(b, BlockStatus) for b in blocks), f"{contract.ALLOCATE}: not BlockStatus objects"
        assert backend.get_num_free_blocks() == free - len(ids), \
            f"{contract.ALLOCATE}: free count went from {free} to {backend.get_num_free_blocks()} for {len(ids)} blocks"
        return blocks

    def assert_free(self, backend: Backend, expected: int, clause: str) -> None:
        got = backend.get_num_free_blocks()
        assert got == expected, f"{clause}: get_num_free_blocks() is {got}, expected {expected}"

    # ------------------------------------------------------------------ declarations
    def test_declares_spec_type_and_medium(self):
        backend = self.backend()
        assert issubclass(backend.spec_type, BlockIDsLoadStoreSpec), f"{contract.DECLARES}: spec_type"
        assert isinstance(backend.medium, str) and backend.medium, f"{contract.DECLARES}: medium"
        assert isinstance(type(backend).persistent, bool), f"{contract.DECLARES}: persistent"
        assert backend.num_blocks == self.num_blocks and backend.block_bytes == self.block_bytes, \
            f"{contract.DECLARES}: made with {self.num_blocks} x {self.block_bytes} B, " \
            f"has {backend.num_blocks} x {backend.block_bytes} B"

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

    # ------------------------------------------------------------------ specs
    def test_load_store_spec_names_the_blocks_in_key_order(self):
        backend = self.backend()
        blocks = self.allocate(backend, range(5))
        order = [3, 0, 4, 1]
        spec = call(contract.SPEC, "get_load_store_spec(4 keys, 4 blocks)", backend.get_load_store_spec,
                    [key(i) for i in order], [blocks[i] for i in order])
        assert isinstance(spec, backend.spec_type), f"{contract.SPEC}: a {type(spec).__name__}"
        assert list(spec.block_ids) == [blocks[i].block_id for i in order], \
            f"{contract.SPEC}: block_ids {list(spec.block_ids)}, expected {[blocks[i].block_id for i in order]}"
        assert len(spec) == len(order), f"{contract.SPEC}: len(spec) is {len(spec)}, expected {len(order)}"
        if hasattr(spec, "keys"):
            assert list(spec.keys) == [key(i) for i in order], f"{contract.SPEC}: keys out of order"
        self.assert_free(backend, self.num_blocks - 5, contract.SPEC)

    def test_load_store_spec_of_nothing(self):
        backend = self.backend()
        spec = call(contract.SPEC, "get_load_store_spec([], [])", backend.get_load_store_spec, [], [])
        assert isinstance(spec, backend.spec_type) and len(spec) == 0, f"{contract.SPEC}: {spec!r} for no blocks"

    # ------------------------------------------------------------------ bytes
    def test_blocks_hold_their_bytes(self):
        backend = self.backend()
        ids = list(range(self.num_blocks))
        blocks = self.allocate(backend, ids)
        data = [payload(i, self.block_bytes) for i in ids]
        self.write_bytes(backend, keys(ids), blocks, data)
        assert self.read_bytes(backend, keys(ids), blocks) == data, f"{contract.BYTES}: read back in order"
        assert self.read_bytes(backend, keys(ids[::-1]), blocks[::-1]) == data[::-1], \
            f"{contract.BYTES}: read back in reverse order"

    # ------------------------------------------------------------------ still_valid, recover, close
    def test_still_valid_is_a_question(self):
        backend = self.backend()
        blocks = self.allocate(backend, range(2))
        self.write_bytes(backend, keys(range(2)), blocks, [payload(i, self.block_bytes) for i in range(2)])
        for b in blocks:
            b.ref_cnt = 0
        answers = [backend.still_valid(b) for b in blocks]
        assert all(isinstance(a, bool) for a in answers), f"{contract.STILL_VALID}: answered {answers!r}"
        assert [backend.still_valid(b) for b in blocks] == answers, f"{contract.STILL_VALID}: the answer changed"
        self.assert_free(backend, self.num_blocks - 2, contract.STILL_VALID)
        if type(backend).persistent:
            assert answers == [True, True], f"{contract.STILL_VALID}: answered {answers} for readable blocks"
        assert self.read_bytes(backend, keys(range(2)), blocks) == [payload(i, self.block_bytes) for i in range(2)], \
            f"{contract.STILL_VALID}: the bytes changed"

    def test_recover_on_a_new_backend(self):
        backend = self.backend()
        found = call(contract.RECOVER_NEW, "recover()", backend.recover)
        assert found == [], f"{contract.RECOVER_NEW}: found {len(found)} blocks"
        self.assert_free(backend, self.num_blocks, contract.RECOVER_NEW)

    def test_close_twice(self):
        backend = self.make_backend(self.num_blocks, self.block_bytes)
        self.allocate(backend, range(2))
        call(contract.CLOSE, "the first close()", backend.close)
        call(contract.CLOSE, "the second close()", backend.close)

    # ------------------------------------------------------------------ persistence
    def test_persistent_blocks_survive_close_and_reopen(self):
        backend = self.backend()
        if not type(backend).persistent:
            pytest.skip(f"{type(backend).__name__}.persistent is False")
        ids = list(range(self.num_blocks - 2))
        blocks = self.allocate(backend, ids)
        data = [payload(i, self.block_bytes) for i in ids]
        self.write_bytes(backend, keys(ids), blocks, data)
        slot_of = {key(i): b.block_id for i, b in zip(ids, blocks)}
        gone = blocks[0]  # freed before the restart: must not come back
        backend.free(gone)
        del slot_of[key(ids[0])]
        backend.close()

        again = self.track(self.reopen(backend))
        found = call(contract.PERSISTENT, "recover() after reopen()", again.recover)
        clause = contract.PERSISTENT
        assert {k: b.block_id for k, b in found} == slot_of, \
            f"{clause}: found {len(found)} blocks, held {len(slot_of)} (or in other slots)"
        assert all(b.ref_cnt == 0 for _, b in found), f"{clause}: recovered blocks must be ready (ref_cnt 0)"
        self.assert_free(again, self.num_blocks - len(found), clause)
        by_key = dict(found)
        survivors = [i for i in ids if key(i) in by_key]
        assert self.read_bytes(again, keys(survivors), [by_key[key(i)] for i in survivors]) == \
            [payload(i, self.block_bytes) for i in survivors], f"{clause}: the bytes changed"
        fresh = self.allocate(again, range(500, 500 + again.get_num_free_blocks()))
        assert not {b.block_id for b in fresh} & set(slot_of.values()), f"{clause}: a recovered slot was handed out"
