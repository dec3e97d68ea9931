"""`BackendTests`' other groups: declarations, specs, bytes, `still_valid`, `recover`, `close`,
persistence."""

from __future__ import annotations

import pytest

from kvtier.core.specs import BlockIDsLoadStoreSpec
from kvtier.testing import backend_contract as contract
from kvtier.testing.backend_harness import BackendHarness, key, keys, payload
from kvtier.testing.clauses import call


class SpecAndLifecycleTests(BackendHarness):
    """What a backend declares and hands out, the bytes it holds, and its life cycle."""

    # ------------------------------------------------------------------ declarations
    def test_declares_spec_type_and_medium(self):
        backend = self.backend()
        assert issubclass(backend.spec_type, BlockIDsLoadStoreSpec), f"{contract.DECLARES}: spec_type"
        assert isinstance(backend.medium, str) and backend.medium, f"{contract.DECLARES}: medium"
        assert isinstance(type(backend).persistent, bool), f"{contract.DECLARES}: persistent"
        assert backend.num_blocks == self.num_blocks and backend.block_bytes == self.block_bytes, \
            f"{contract.DECLARES}: made with {self.num_blocks} x {self.block_bytes} B, " \
            f"has {backend.num_blocks} x {backend.block_bytes} B"

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
