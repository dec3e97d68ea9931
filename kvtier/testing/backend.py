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

from kvtier.testing.backend_io import SpecAndLifecycleTests
from kvtier.testing.backend_slots import SlotTests

__all__ = ["BackendTests"]


class BackendTests(SlotTests, SpecAndLifecycleTests):
    """Subclass as `class TestMine(BackendTests)` and implement `make_backend`; persistent
    backends also implement `reopen`. `num_blocks`/`block_bytes` are the geometry the tests use
    (a backend with a minimum block size raises them in the subclass). The hooks and helpers are
    `kvtier.testing.backend_harness.BackendHarness`'s."""
