"""Fixtures of the remote store's tests: private servers for tests that kill, pause or fill them, and
stores built on them (the session's shared servers are in tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
from remote.servers import start_cluster, start_server

from kvtier.remote.options import ClientOptions
from kvtier.remote.store import RemoteStore

_prefixes = itertools.count()


@pytest.fixture
def private_server(tmp_path):
    server = start_server(tmp_path / "valkey")
    yield server
    server.stop()


@pytest.fixture
def private_cluster(tmp_path):
    cluster = start_cluster(tmp_path / "cluster")
    yield cluster
    cluster.stop()


@pytest.fixture
def make_store():
    """`make_store(url, **kw)`: a RemoteStore with a prefix unique to the test run, closed at teardown.
    Timeouts default to 2 s here (tests about timeouts pass their own): a busy CI machine can hold a
    1 MiB SET past 250 ms while the server evicts, and those tests are not about that."""
    stores = []

    def make(url: str, *, block_bytes: int = 4096, tp: int = 1, fingerprint: str = "model:abc", layout: str = "L1",
             key_prefix: str | None = None, **options) -> RemoteStore:
        options.setdefault("timeout_s", 2.0)
        prefix = key_prefix or f"kvt:test{next(_prefixes)}"
        store = RemoteStore(ClientOptions(url, **options), key_prefix=prefix, fingerprint=fingerprint,
                            layout=layout, block_bytes=block_bytes, tp=tp)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
