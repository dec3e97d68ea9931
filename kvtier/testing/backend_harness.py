"""The harness under `BackendTests`: the hooks a subclass implements (`make_backend`, `reopen`,
`write_bytes`/`read_bytes`) and the helpers every test group uses."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.core.keys import OffloadKey, make_offload_key
from kvtier.core.types import BlockStatus
from kvtier.testing import backend_contract as contract
from kvtier.testing.clauses import call
from kvtier.tiers.base import Backend


def key(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), i % 3)


def payload(i: int, size: int) -> bytes:
    """Distinct, reproducible bytes for block `i`."""
    return hashlib.shake_128(str(i).encode()).digest(size)


def keys(ids: range | Sequence[int]) -> list[OffloadKey]:
    return [key(i) for i in ids]


class BackendHarness:
    """Hooks and helpers of the backend suite. `num_blocks`/`block_bytes` are the geometry the
    tests use (a backend with a minimum block size raises them in the subclass)."""

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
