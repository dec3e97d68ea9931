"""`HostClient`: an engine's connection to the host owner, where failure is a miss, never a stall.

Every call has a deadline (`SharedHost.timeout_ms`): past it, or when the owner is not running,
the call raises `HostUnavailable` and the engine answers a miss (or skips the store). After a
failure the client stays away for `backoff_s` (calls fail at once, without touching the socket),
so an owner that hangs costs one deadline per backoff, not one per call.

A call that timed out leaves its connection open, so what the engine holds in the owner (load
pins, stores being written) stays held while the engine's copies may still use those slots; its
late answer is recognised by its id and skipped. What the owner reserved for the call itself (the
slots of a `prepare_store`, the pins of a `prepare_load`) is never used, so the client tells the
owner at once that it gave up (`cancel`, sent without waiting): the owner answers a connection's
requests in order, so it undoes that call as soon as it has answered it, before any later request
of this engine. When even that cannot be sent, the connection is closed (the owner then releases
what it held after its grace period). A connection the owner closed, or one that
died with it, is replaced at the next call after the backoff: a new `hello`, and the region
the owner names then (`region`; a restarted owner has a new one: `generation` counts them).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.config.shared import SharedHost
from kvtier.host.listener import peer_uid
from kvtier.host.wire import FrameReader, HostUnavailable, encode, read_frame

log = logging.getLogger(__name__)

_T = TypeVar("_T")

BACKOFF_S = 1.0
HELLO_TIMEOUT_S = 30.0
CANCEL_SEND_S = 0.05  # how long sending a `cancel` may take (the socket's buffer takes it at once unless full)


class HostRefused(HostUnavailable):
    """The owner answered with an error (a bad request, or a config it cannot serve)."""


class HostClient:
    """One engine's calls to the owner (the module docstring); thread-safe, one call at a time."""

    def __init__(self, shared: SharedHost, hello: dict[str, Any], *, backoff_s: float = BACKOFF_S):
        self.shared = shared
        self.backoff_s = backoff_s
        self._hello = {"op": "hello", **hello, "client": {"pid": os.getpid()}}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._down_until = 0.0
        self._why = ""
        self.region: dict[str, Any] | None = None  # where the owner's first tier is (from the last hello)
        self.tier = ""  # its name
        self.generation = 0  # hellos answered: a new one means a new connection (and maybe a new owner)
        self.failures = 0  # calls that ended as misses because the owner did not serve them

    def connect(self, timeout_s: float = HELLO_TIMEOUT_S) -> dict[str, Any]:
        """Say hello now, waiting up to `timeout_s` (an engine's start: the owner builds the
        namespace at its identity's first engine, file tiers included, which takes longer than
        one call's `timeout_ms`). `HostRefused` if the owner refuses this engine's identity or
        YAML; `HostUnavailable` if it does not answer. Returns the region it names."""
        with self._lock:
            self._guarded(self._connect, time.monotonic() + max(timeout_s, self.shared.timeout_s))
            assert self.region is not None
            return self.region

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        """The owner's answer to `op`; `HostUnavailable` when there is none within the deadline."""
        with self._lock:
            now = time.monotonic()
            if now < self._down_until:
                self.failures += 1
                raise HostUnavailable(f"the kvtier host owner is unavailable ({self._why}); retrying in "
                                      f"{self._down_until - now:.1f} s")
            return self._guarded(self._connected_round_trip, {"op": op, **arguments}, now + self.shared.timeout_s)

    def _connected_round_trip(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        if self._sock is None:
            self._connect(deadline)
        try:
            return self._round_trip(request, deadline)
        except TimeoutError:
            self._cancel(request.get("id"))
            raise

    def _cancel(self, ident: Any) -> None:
        """Tell the owner that this engine gave up waiting for request `ident` (the module docstring):
        it undoes what it reserved for it. The connection is closed when that cannot be sent."""
        if self._sock is None or ident is None:
            return  # (a request not sent whole closed the connection: the owner releases what it held)
        try:
            self._send({"op": "cancel", "of": ident}, time.monotonic() + CANCEL_SEND_S)
        except OSError:
            self._close()

    def _guarded(self, work: Callable[..., _T], *args: Any) -> _T:
        """`work(*args)`, its failures made `HostUnavailable` (with the backoff, `_fail`); a
        refusal at hello also backs off: the engine is not served until the owner's answer changes."""
        try:
            return work(*args)
        except HostRefused as exc:
            if self._sock is None:
                self._down_until, self._why = time.monotonic() + self.backoff_s, str(exc)
            raise
        except (HostUnavailable, OSError) as exc:
            self._fail(exc)
            raise HostUnavailable(self._why) from None

    def notify(self, op: str, **arguments: Any) -> bool:
        """Send `op` without waiting for its answer (skipped when it comes, at a later call): for
        calls whose outcome the engine does not need, e.g. releasing pins. False when it could
        not be sent (the owner releases what a lost connection held)."""
        with self._lock:
            if self._sock is None or time.monotonic() < self._down_until:
                return False
            try:
                self._send({"op": op, **arguments}, time.monotonic() + self.shared.timeout_s)
                return True
            except OSError as exc:
                self._fail(exc)
                return False

    def _connect(self, deadline: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(self.shared.socket)
            owner = peer_uid(sock)
        except OSError:
            sock.close()
            raise
        if owner != os.getuid():  # (whatever the socket's directory lets others do, only our owner is heard)
            sock.close()
            raise HostUnavailable(f"{self.shared.socket} is served by uid {owner}, not by this user ({os.getuid()})")
        self._sock, self._reader = sock, FrameReader()
        try:
            answer = self._round_trip(dict(self._hello), deadline)
        except BaseException:
            self._close()  # (a hello answered late would leave `region` naming another owner's region)
            raise
        self.region, self.tier = answer["region"], answer["tier"]
        self.generation += 1
        log.info("kvtier: joined the host hierarchy %s of owner pid %s (region %s)", answer.get("namespace"),
                 answer.get("owner_pid"), self.region["shm_name"])

    def _send(self, request: dict[str, Any], deadline: float) -> int:
        """Send `request` with a new id (returned)."""
        sock = self._sock
        assert sock is not None
        request["id"] = ident = next(self._ids)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.sendall(encode(request))
        except TimeoutError:
            self._close()  # (a frame may be half sent: the stream cannot be trusted any more)
            raise
        return ident

    def _round_trip(self, request: dict[str, Any], deadline: float) -> dict[str, Any]:
        ident = self._send(request, deadline)
        sock = self._sock
        assert sock is not None
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            answer = read_frame(sock, self._reader)
            if answer.get("id") == ident:
                break  # (an earlier call's late answer is skipped)
        if "error" in answer:
            raise HostRefused(f"the kvtier host owner refused {request['op']}: {answer['error']}")
        return answer

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        timed_out = isinstance(exc, TimeoutError)
        self._why = ("no answer within timeout_ms " f"{self.shared.timeout_ms}" if timed_out
                     else f"{type(exc).__name__}: {exc}")
        if not timed_out:
            self._close()
        if time.monotonic() >= self._down_until:
            log.warning("kvtier: the host owner at %s did not serve a call (%s): misses for %.1f s, then retrying",
                        self.shared.socket, self._why, self.backoff_s)
        self._down_until = time.monotonic() + self.backoff_s

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Close the connection: the owner releases what it still holds after its grace period."""
        with self._lock:
            self._close()


def join(shared: SharedHost, identity: dict[str, Any], config: dict[str, Any]) -> HostClient:
    """A client of the owner at `shared.socket` for an engine of `identity` whose YAML is `config`
    (a plain mapping), with its hello said: `HostRefused` when the owner refuses them (another
    engine of this identity runs other tiers: fix the YAML). An owner not running now is not an
    error: the engine's calls are misses until it is (a warning says so)."""
    client = HostClient(shared, {"identity": identity, "config": config})
    try:
        client.connect()
    except HostRefused:
        client.close()
        raise
    except HostUnavailable as exc:
        log.warning("kvtier: the host owner at %s is not serving (%s): misses until it does", shared.socket, exc)
    return client
