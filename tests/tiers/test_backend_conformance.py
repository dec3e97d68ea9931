"""`kvtier.testing.backend.BackendTests` run on every backend in `kvtier.transfer.registry.BACKENDS`;
broken backends are shown to fail it.

A tier kind added to the registry needs one `Test...(BackendTests)` class here: the coverage test
below derives the kinds from the registry and fails naming a kind no class here runs the suite on.
Each class's `make_backend` must work on a bare instance (no pytest fixture): the coverage test
builds one backend from each class to see which kind it tests.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvtier import ConfigError
from kvtier.core.types import BlockStatus
from kvtier.testing.backend import BackendTests
from kvtier.testing.backend_harness import key, keys, payload
from kvtier.testing.fake_remote import FakeServer, fake_valkey
from kvtier.tiers.cpu import CPUBackend
from kvtier.tiers.file import FileBackend
from kvtier.tiers.memory import MemoryBackend
from kvtier.transfer import registry


class TestMemoryBackend(BackendTests):
    def make_backend(self, num_blocks, block_bytes):
        return MemoryBackend("mem", num_blocks, block_bytes, 16)


class TestCPUBackend(BackendTests):
    def make_backend(self, num_blocks, block_bytes):
        return CPUBackend("cpu", num_blocks, block_bytes, 16, pin="false")


class TestFileBackend(BackendTests):
    """Its directory: `root` where a test set one, else a temporary one of this instance's (pytest
    makes an instance per test), removed at teardown."""

    def make_backend(self, num_blocks, block_bytes):
        if "root" not in self.__dict__:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvtier-conformance-")
            self.root = Path(self._tmp.name) / "kv"
        return FileBackend.from_config("disk", num_blocks, block_bytes, 16, {
            "root_dir": str(self.root), "io": "posix", "fingerprint": "conformance-model", "sync_interval": 0})

    def reopen(self, backend):
        return self.make_backend(backend.num_blocks, backend.block_bytes)

    def teardown_method(self, method=None):
        super().teardown_method(method)
        tmp = self.__dict__.pop("_tmp", None)
        if tmp is not None:
            tmp.cleanup()


class TestValkeyBackend(BackendTests):
    """A valkey tier on a fake server. Its slots are handles of keys; its persistence is the
    server's: blocks are not recovered as slots but found again by probing."""

    @property
    def server(self) -> FakeServer:
        """This instance's fake server (pytest makes an instance per test)."""
        return self.__dict__.setdefault("_server", FakeServer())

    def make_backend(self, num_blocks, block_bytes, fingerprint="conformance-model"):
        return fake_valkey(self.server, "remote", num_blocks, block_bytes, fingerprint=fingerprint)

    def write_bytes(self, backend, keys, blocks, data):
        backend.put_blocks(list(keys), list(data))

    def read_bytes(self, backend, keys, blocks):
        out = [bytearray(backend.block_bytes) for _ in blocks]
        backend.get_blocks(list(keys), out)
        return [bytes(o) for o in out]

    def probe(self, backend, probe_keys):
        backend.request_probe(probe_keys)
        for _ in range(500):
            answers = backend.probe_results()
            if answers:
                return answers[0][1]
            import time

            time.sleep(0.01)
        raise AssertionError("the probe thread never answered")

    def test_persistent_blocks_survive_close_and_reopen(self):
        """Replaces the slot-recovery check: nothing is recovered as slots (the server is the
        index), every block written is found by a probe of the reopened backend and reads back
        byte-identical, a freed handle's value included (free never deletes remotely), and a
        backend of another identity finds none of them."""
        backend = self.backend()
        ids = list(range(self.num_blocks))
        blocks = self.allocate(backend, ids)
        data = [payload(i, self.block_bytes) for i in ids]
        self.write_bytes(backend, keys(ids), blocks, data)
        backend.free(blocks[0])
        backend.close()
        again = self.track(self.make_backend(self.num_blocks, self.block_bytes))
        assert again.recover() == []
        assert self.probe(again, keys(ids) + [key(999)]) == [True] * len(ids) + [False]
        assert self.read_bytes(again, keys(ids), blocks) == data
        other = self.track(self.make_backend(self.num_blocks, self.block_bytes, fingerprint="another-model"))
        assert self.probe(other, keys(ids)) == [False] * len(ids)


def backend_suites(namespace: Mapping[str, Any]) -> dict[str, type]:
    """The conformance classes of a test module (its globals): `Test...` subclasses of BackendTests."""
    return {name: obj for name, obj in namespace.items()
            if name.startswith("Test") and isinstance(obj, type) and issubclass(obj, BackendTests)}


def kind_tested(suite_cls: type, registered: Mapping[str, str]) -> str | None:
    """The registered kind (a name of `registered`) whose backend `suite_cls` tests: the most specific
    registered class of the backend its `make_backend` builds (a test double subclassing a
    registered backend tests that backend); None if it builds none of them."""
    classes = {registry.load_object(path): name for name, path in registered.items()}
    suite = suite_cls()
    try:
        backend = suite.backend()
        return next((classes[c] for c in type(backend).__mro__ if c in classes), None)
    finally:
        suite.teardown_method()


def kinds_without_a_suite(registered: Mapping[str, str], suites: Iterable[type]) -> list[str]:
    """The names of `registered` (name -> "module:Class", as `registry.BACKENDS`) no suite tests."""
    tested = {kind_tested(cls, registered) for cls in suites}
    return sorted(name for name in registered if name not in tested)


def test_every_registered_backend_runs_the_suite():
    """Every kind in `registry.BACKENDS`, whatever they are, has a BackendTests class here."""
    assert registry.BACKENDS, "no backend is registered"
    missing = kinds_without_a_suite(registry.BACKENDS, backend_suites(globals()).values())
    assert missing == [], (f"registered backends no BackendTests class in {__name__} runs the suite on: {missing}; "
                           "add a `class Test...(BackendTests)` here whose make_backend builds one")


def test_a_file_backend_reopened_under_another_identity_serves_nothing(tmp_path):
    """The suite's reopen keeps the identity; with another model the blocks must not come back
    (the open is refused, or with `on_identity_change: reset` they are erased)."""
    suite = TestFileBackend()
    suite.root = tmp_path / "kv"
    backend = suite.make_backend(4, 4096)
    blocks = backend.allocate_blocks([b"k" * 16])
    suite.write_bytes(backend, [b"k" * 16], blocks, [bytes(4096)])
    backend.close()
    with pytest.raises(ConfigError, match="holds the blocks of another model"):
        FileBackend("disk", 4, 4096, 16, root_dir=str(suite.root), io="posix", fingerprint="other-model")
    other = FileBackend("disk", 4, 4096, 16, root_dir=str(suite.root), io="posix", fingerprint="other-model",
                        sync_interval=0, on_identity_change="reset")
    try:
        assert other.recover() == []
    finally:
        other.close()


# ---------------------------------------------------------------- the suite catches broken backends
class DoubleAllocating(MemoryBackend):
    """Broken: the last slot is never used; whoever gets it is handed slot 0 instead (counts stay right)."""

    def allocate_blocks(self, keys):
        return [BlockStatus(b.block_id % (self.num_blocks - 1)) for b in super().allocate_blocks(keys)]


class DoubleFreeing(MemoryBackend):
    """Broken: `free` returns the slot twice, so it is later handed to two owners."""

    def free(self, block):
        super().free(block)
        self.slots.release(block.block_id)


class SpecInSlotOrder(MemoryBackend):
    """Broken: the spec lists the slots sorted instead of in the order of the keys."""

    def get_load_store_spec(self, keys, blocks):
        return self.spec_type(sorted(b.block_id for b in blocks))


class LeakyPersistent(MemoryBackend):
    """Broken: declares persistence but every reopen is empty."""

    persistent = True


class BrokenSuite(BackendTests):
    backend_class: type = MemoryBackend

    def make_backend(self, num_blocks, block_bytes):
        return self.backend_class("broken", num_blocks, block_bytes, 16)

    def reopen(self, backend):
        return self.make_backend(backend.num_blocks, backend.block_bytes)


@pytest.mark.parametrize("broken, check", [
    (DoubleAllocating, "test_no_slot_handed_out_twice_while_allocated"),
    (DoubleAllocating, "test_blocks_hold_their_bytes"),
    (DoubleFreeing, "test_allocate_and_free_move_the_free_count"),
    (DoubleFreeing, "test_freed_slots_are_reused_and_never_shared"),
    (SpecInSlotOrder, "test_load_store_spec_names_the_blocks_in_key_order"),
    (LeakyPersistent, "test_persistent_blocks_survive_close_and_reopen"),
])
def test_suite_fails_a_broken_backend(broken, check):
    suite = BrokenSuite()
    suite.backend_class = broken
    try:
        with pytest.raises(AssertionError):
            getattr(suite, check)()
    finally:
        suite.teardown_method()


def test_the_broken_suite_passes_on_a_correct_backend():
    """The failures above come from the defects, not from the harness."""
    suite = BrokenSuite()
    for check in ("test_no_slot_handed_out_twice_while_allocated", "test_blocks_hold_their_bytes",
                  "test_allocate_and_free_move_the_free_count", "test_freed_slots_are_reused_and_never_shared",
                  "test_load_store_spec_names_the_blocks_in_key_order"):
        try:
            getattr(suite, check)()
        finally:
            suite.teardown_method()
