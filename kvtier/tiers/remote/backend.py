"""`ValkeyBackend`: a tier shared by many processes on a Valkey/Redis server or cluster (medium REMOTE).

The server is the index and owns the bytes' lifetime (its `maxmemory` and eviction policy bound
them). A slot of this backend is a *handle*: a key this process knows to be on the server (it
published it, or a probe found it). `num_blocks` bounds the handles; `free` forgets a handle
locally and never deletes anything remotely. Identity: values are stored under keys that name the
tenant (`key_prefix`), the model (`fingerprint`) and the layout, and carry a verified header, so a
value of another model, layout or tenant is never served (`kvtier.tiers.remote`). With `tp` > 1 a block
is stored as `tp` values, value r holding bytes [r*P, (r+1)*P) of the block (P = block_bytes / tp:
under vLLM, rank r's part of the scheduler-side CPU slot); a block is served only when every rank's
value is there and verifies.

Threads. Socket I/O happens only on the handlers' pool (`put_blocks`, `get_blocks`) and on the
backend's probe thread (`probes.Probes`: `request_probe` hands it a batch; `probe_results`
collects the answers).
Deadlines: a probe batch must be answered within `timeout_ms` of `request_probe` (one in flight,
at most `runtime.MAX_QUEUED` waiting, those past their deadline dropped unsent); a block a
probe found must then be read by that same deadline, and any other read by the deadline its
handler passes (`timeout_ms` after the job was submitted): a promotion never outlives the time its
lookup may wait. The first failure logs one WARNING with its cause (`runtime.FailureNotice`).
The control methods (`available`, `accepts_writes`, `probe_results`, `failed_keys`) only read
state, so the manager can call them on the scheduler thread. The store itself is
`kvtier.tiers.remote.store.RemoteStore` (imported when the backend is built, so `kvtier config check`
works without the Redis client library); `store_factory` replaces it (tests use
`kvtier.testing.fake_remote`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvtier.core.errors import BlocksFailed, ClosedError, ConfigError
from kvtier.core.keys import OffloadKey
from kvtier.core.types import BlockStatus
from kvtier.tiers.base import Backend
from kvtier.tiers.remote import options as option_checks
from kvtier.tiers.remote.control_calls import ControlCalls
from kvtier.tiers.remote.errors import BlockMissing, RemoteUnavailable, without_echo
from kvtier.tiers.remote.probes import Probes
from kvtier.tiers.remote.runtime import FailureNotice, FoundBy, WritePause
from kvtier.tiers.remote.spec import HOPS, RemoteLoadStoreSpec
from kvtier.tiers.remote.url import redact_url

log = logging.getLogger("kvtier.tiers.remote")  # the shared tier's logger (runtime.py logs there too)

_MIB = 1 << 20
SLOW_WRITE_FRACTION = 0.5  # a write slower than this fraction of the timeout pauses publishing
HANDLE_TTL_S = 60.0  # a handle older than this is not trusted to dedupe a publish (`stale`)
CLOSE_MARGIN_S = 0.1  # close() waits for the probe thread at most its deadline plus this


def _real_store(client: dict[str, Any], **store: Any) -> Any:
    from kvtier.tiers.remote.options import ClientOptions
    from kvtier.tiers.remote.store import RemoteStore

    return RemoteStore(ClientOptions(**client), **store)


def _check_arguments(name: str, block_bytes: int, given: dict[str, Any], table: dict[str, Any]) -> None:
    """The constructor's arguments, each by its option's check in `table`, then together: one
    `ConfigError` naming every option that is wrong (a `ValueError` for a block size of 0)."""
    option_checks.check_given(given, table)
    tp, fingerprint = given["tp"], given["fingerprint"]
    if block_bytes <= 0:
        raise ValueError(f"valkey tier {name!r} needs block_bytes > 0, got {block_bytes}")
    if block_bytes % tp:
        raise ConfigError([("tp", f"block_bytes {block_bytes} is not a multiple of tp = {tp}: a block is "
                                  f"stored as one value per tensor-parallel rank, all of one size")])
    if not fingerprint:
        raise ConfigError([("fingerprint", f"empty: valkey tier {name!r} shares blocks across processes and "
                                           f"must know whose KV they are (the builder passes the model)")])


class ValkeyBackend(ControlCalls, Backend):
    """Handles of blocks on a Valkey/Redis server (see the module docstring); a `RemoteBlocks`. The
    control plane's probe and write-pause calls are `ControlCalls`' (control_calls.py)."""

    spec_type = RemoteLoadStoreSpec
    medium = "REMOTE"
    handlers = HOPS  # (max_blocks stays None: handles cost nothing; the policy indexing them is the limit)
    persistent = True  # the builder passes fingerprint and layout: the identity of the values
    shared = True
    OPTIONS = option_checks.OPTIONS
    # (client options dict, key_prefix=, fingerprint=, layout=, block_bytes=, tp=) -> a RemoteStore
    store_factory: ClassVar[Callable[..., Any] | None] = None

    @classmethod
    def check_options(cls, options: dict) -> list[tuple[str, str]]:
        return option_checks.check_options(options)

    @classmethod
    def check_environment(cls, options: dict) -> tuple[list[str], list[tuple[str, str]]]:
        """The password and TLS files the options name, then (when they are fine) one PING of the
        server with them (`env.reach`: the cause of a failure is the problem)."""
        notes, problems = option_checks.check_environment(options)
        if problems:
            return notes, problems
        from kvtier.tiers.remote.env import reach

        reached, problems = reach(options)
        return notes + reached, problems

    def __init__(self, name: str, num_blocks: int, block_bytes: int, block_size: int = 0, *, url: str,
                 username: str | None = None, password_env: str | None = None, password_file: str | None = None,
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 tls_verify: bool = True, key_prefix: str = "kvt", timeout_ms: int = 250,
                 max_inflight_mib: float = 256.0, breaker_failures: int = 3, breaker_open_s: float = 5.0,
                 negative_ttl_s: float = 2.0, threads: int = 4, tp: int = 1, fingerprint: str = "",
                 layout: str = ""):
        super().__init__(name, num_blocks, block_bytes, block_size)
        given = dict(url=url, username=username, password_env=password_env, password_file=password_file,
                     tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file, tls_key_file=tls_key_file,
                     tls_verify=tls_verify, key_prefix=key_prefix, timeout_ms=timeout_ms,
                     max_inflight_mib=max_inflight_mib, breaker_failures=breaker_failures,
                     breaker_open_s=breaker_open_s, negative_ttl_s=negative_ttl_s, threads=threads, tp=tp,
                     fingerprint=fingerprint)
        _check_arguments(name, block_bytes, given, self.OPTIONS)
        self.url, self.key_prefix, self.tp = url, key_prefix, tp
        self.fingerprint, self.layout = fingerprint, layout  # the values' identity (as a file tier's)
        self.num_threads = threads
        self.max_inflight_bytes = max(block_bytes, int(max_inflight_mib * _MIB))
        self.probe_timeout_s = timeout_ms / 1000
        self.negative_ttl_s = float(negative_ttl_s)
        self._breaker_open_s = float(breaker_open_s)
        password = option_checks.resolve_password(password_env, password_file)
        option_checks.check_tls_files(given)
        self._client = dict(url=url, username=username, tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file,
                            tls_key_file=tls_key_file, tls_verify=tls_verify, timeout_s=self.probe_timeout_s,
                            connect_timeout_s=self.probe_timeout_s, breaker_failures=breaker_failures,
                            breaker_open_s=self._breaker_open_s)
        self._password = password  # a Secret: never in a repr
        self._store_args = dict(key_prefix=key_prefix, fingerprint=fingerprint, layout=layout,
                                block_bytes=block_bytes, tp=tp)
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._down_until = 0.0  # the store could not be built: retried after this time
        self.notice = FailureNotice(name, redact_url(url))
        self._writes = WritePause(name, self._breaker_open_s, self.notice)
        self._born: dict[int, float] = {}  # slot -> when its handle was made
        self._lost_at = float("-inf")  # when a read last found a key gone: older handles are `stale`
        self._lock = threading.Lock()  # guards _key_of and _bad across the handler threads
        self._key_of: dict[int, bytes] = {}  # slot -> key of the handle
        self._bad: set[bytes] = set()  # keys whose last read failed (still_valid answers False)
        self._failed: deque[bytes] = deque()  # keys whose read failed, not yet taken by the manager
        self._found_by = FoundBy()  # key found by a probe -> its batch's deadline (for the read)
        self._closed = False
        self.counters = {"probes": 0, "probe_failures": 0, "slow_writes": 0, "write_failures": 0,
                         "read_failures": 0, "probes_shed": 0, "late_writes": 0}
        self._probes = Probes(name, self._store_for_io, self.probe_timeout_s, self.notice, self._found_by,
                              self.counters)
        self._build_store(at_start=True)
        log.info("valkey tier %s: %s", name, self)

    def __repr__(self) -> str:
        return (f"ValkeyBackend(name={self.name!r}, url={self.url!r}, key_prefix={self.key_prefix!r}, "
                f"handles={self.num_blocks}, password={'set' if self._password else 'none'})")

    # ------------------------------------------------------------------ the store
    def _build_store(self, at_start: bool = False) -> Any:
        with self._store_lock:
            if self._store is not None:
                return self._store
            if self._closed:
                raise ClosedError(f"valkey tier {self.name!r} is closed")
            factory = type(self).store_factory or _real_store
            client = dict(self._client, password=self._password.value if self._password else None)
            try:
                self._store = factory(client, **self._store_args)
            except ImportError as exc:
                raise ConfigError([("backend", f"valkey tier {self.name!r} needs the Redis client library "
                                               f"(pip install 'redis[hiredis]'): {exc}")]) from None
            except ValueError as exc:  # ClientOptions: "<option>: what is wrong"
                option, sep, message = str(exc).partition(": ")
                raise ConfigError([(option if sep and option in self.OPTIONS else "", str(exc) if not sep
                                    or option not in self.OPTIONS else message)]) from None
            except Exception as exc:  # noqa: BLE001 - a server that is down at start is retried later
                if not at_start:
                    raise
                self._down_until = time.monotonic() + self._breaker_open_s
                log.warning("valkey tier %s: cannot reach %s at start (%s: %s); lookups miss until it answers",
                            self.name, self.url, type(exc).__name__, without_echo(str(exc)))
                return None
            return self._store

    def _store_for_io(self) -> Any:
        store = self._store
        return store if store is not None else self._build_store()

    def client_options(self) -> Any:
        """The store's `ClientOptions` (password included, hidden from its repr), e.g. for a
        baseline client with the same settings. Builds the store if needed (socket I/O)."""
        return self._store_for_io().options

    @property
    def store(self) -> Any:
        """The client store (`kvtier.tiers.remote.store.RemoteStore`: servers, breakers, key
        layout, counters), or None while it is not built: for inspection, tests and benchmarks."""
        return self._store

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open (or the store could not be built lately)."""
        store = self._store
        if store is None:
            return time.monotonic() >= self._down_until
        return bool(store.available)

    def stale(self, block: BlockStatus) -> bool:
        """Whether a handle may no longer match the server: made more than `HANDLE_TTL_S` ago, or
        before a read found a key gone (a restart or FLUSHALL loses every value; an eviction
        may have taken others). A stale handle does not stop a publish of its block."""
        with self._lock:
            born = self._born.get(block.block_id)
        return born is None or born < max(self._lost_at, time.monotonic() - HANDLE_TTL_S)

    # ------------------------------------------------------------------ slots (handles)
    def allocate_blocks(self, keys: Sequence[OffloadKey]) -> list[BlockStatus]:
        blocks = super().allocate_blocks(keys)
        now = time.monotonic()
        with self._lock:
            for key, block in zip(keys, blocks):
                self._key_of[block.block_id] = bytes(key)
                self._born[block.block_id] = now
        return blocks

    def free(self, block: BlockStatus) -> None:
        """Forget the handle; the value stays on the server."""
        with self._lock:
            key = self._key_of.pop(block.block_id, None)
            self._born.pop(block.block_id, None)
            if key is not None:
                self._bad.discard(key)
        super().free(block)

    def still_valid(self, block: BlockStatus) -> bool:
        """After a failed read: False for a handle whose own read failed (its key is dropped and
        negative-cached), True for one read fine in a job that failed on another key."""
        with self._lock:
            key = self._key_of.get(block.block_id)
            return key is not None and key not in self._bad

    def recover(self) -> list[tuple[OffloadKey, BlockStatus]]:
        """Nothing: the server is the index, found again by probing."""
        return []

    # ------------------------------------------------------------------ bytes (handler threads)
    def _check_buffers(self, keys: Sequence[bytes], buffers: Sequence) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
        for i, buf in enumerate(buffers):
            if memoryview(buf).nbytes != self.block_bytes:
                raise ValueError(f"buffer {i} holds {memoryview(buf).nbytes} bytes, a block is {self.block_bytes}")

    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence, deadline: float | None = None) -> int:
        """Store `buffers[i]` under `keys[i]`, by `deadline` when given (else each write by
        `timeout_ms`). A write that fails (server full, unreachable) or is slow pauses writes for
        `breaker_open_s` (one WARNING the first time); the keys it and the writes after it did not
        store, those not written by `deadline`, and those of jobs that start while writes are paused,
        are not sent and are reported by `take_unsent` (the job itself succeeds: a full server is
        not an error of the job). Raises only for buffers that do not match the keys."""
        self._check_buffers(keys, buffers)
        sent = self._writes.write(self._store_for_io, keys, buffers, self.probe_timeout_s * SLOW_WRITE_FRACTION,
                                  self.counters, deadline)
        with self._lock:
            self._bad.difference_update(map(bytes, keys))
        return sent

    def get_blocks(self, keys: Sequence[bytes], buffers: Sequence, deadline: float | None = None) -> int:
        """Read and verify `keys[i]` into `buffers[i]`, all by `deadline` (a `time.monotonic()` value;
        default `timeout_ms` from now), or by the deadline of the probe that found them when that is
        earlier. Every key is tried (until the server is unreachable or the deadline passed); those
        that failed are remembered (`failed_keys`) and raise `BlocksFailed` (the others were read)."""
        self._check_buffers(keys, buffers)
        deadline = self._found_by.deadline(keys, deadline, self.probe_timeout_s)
        first: BaseException | None = None
        failed: list[int] = []
        got = 0
        for i, (key, buf) in enumerate(zip(keys, buffers)):
            try:
                got += self._store_for_io().read_block(bytes(key), memoryview(buf).cast("B"), deadline)
            except Exception as exc:  # noqa: BLE001 - recorded per key, the first one raised
                first = first or exc
                down = isinstance(exc, (RemoteUnavailable, ClosedError))
                if isinstance(exc, BlockMissing):
                    self._lost_at = time.monotonic()
                if isinstance(exc, RemoteUnavailable):
                    self.notice.failed(exc)
                self._note_failed(keys[i:] if down else [key])
                failed += range(i, len(keys)) if down else [i]
                if down:
                    break
        if first is not None:
            raise BlocksFailed(f"{type(first).__name__}: {first}", failed, got) from first
        return got

    def _note_failed(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._bad.update(map(bytes, keys))
            self._failed.extend(map(bytes, keys))
            self.counters["read_failures"] += len(keys)

    def failed_keys(self) -> list[bytes]:
        """Keys whose reads failed since the last call (thread-safe handoff to the manager)."""
        out = []
        while self._failed:
            out.append(self._failed.popleft())
        return out

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Stop the probe thread and close the store (idempotent). Nothing is deleted remotely.
        Returns within about `timeout_ms`: the store's sockets are closed first (a probe blocked on
        one fails at once) and the probe thread, bounded by its deadline anyway, is waited for at
        most `timeout_ms` + `CLOSE_MARGIN_S`."""
        if self._closed:
            return
        self._closed = True
        self._probes.stop()
        with self._store_lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()
        self._probes.join(self.probe_timeout_s + CLOSE_MARGIN_S)
