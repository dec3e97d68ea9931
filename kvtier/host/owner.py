"""`HostOwner`: the one owner of the host's shared hierarchies (`kvtier serve`).

It listens on a Unix socket (`kvtier.host.listener`: private directory, 0600, its own user only)
and serves each connection on a thread of its own, at most `max_clients` at once (one more is
told so and closed). A connection starts with `hello` (its engine's identity and YAML), which
names its namespace (`kvtier.host.namespace`: built at the first engine of an identity) and
answers where the namespace's CPU region is; then one request at a time, each answered before
the next is read. Engines map the region and copy their blocks in and out themselves: only keys
and slot numbers cross the socket.

A heartbeat thread steps every namespace every `STEP_S` (finished copies, promotions, cascade
writes, expired leases), every `IDLE_STEP_S` while no engine calls and nothing is in flight.
`close` stops accepting, writes each namespace's dirty CPU blocks to the tier below (at most
`flush_timeout` s) and closes the tiers; a restarted owner finds the file tiers' blocks again
(their journals) and starts the CPU tiers empty.

Namespaces are bounded: at most `max_namespaces` at once (an engine of one more identity is
refused at hello, naming the limit), and one that no engine has used for `idle_namespace_s` is
closed as at the owner's stop (its region goes; its file tiers keep their blocks), so a host that
moves on to other models gets their memory back. An engine of that identity saying hello while it
closes waits for the close (its deadline turns the wait into misses), then gets a new namespace
that finds the file tiers' blocks again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.host.listener import listen, peer_uid
from kvtier.host.namespace import LEASE_GRACE_S, Identity, Ledger, Namespace
from kvtier.host.wire import FrameError, FrameReader, HostUnavailable, encode, read_frame

log = logging.getLogger(__name__)

STEP_S = 0.002  # heartbeat period: how soon a finished copy is accounted, a promotion started
IDLE_STEP_S = 0.05  # its period while no engine called for a while and nothing is in flight
MAX_CLIENTS = 64
SEND_TIMEOUT_S = 5.0  # a client that does not read its answers this long is disconnected
FLUSH_TIMEOUT_S = 60.0
MAX_NAMESPACES = 16  # model identities served at once: each holds a CPU region of its first tier's capacity
IDLE_NAMESPACE_S = 600.0  # a namespace unused this long is closed (0: kept until the owner stops)
IDLE_CHECK_S = 1.0  # how often the heartbeat looks for idle namespaces


class HostOwner:
    """Serves the shared hierarchies of this host on `socket_path` (the module docstring)."""

    def __init__(self, socket_path: str, *, max_clients: int = MAX_CLIENTS, lease_grace_s: float = LEASE_GRACE_S,
                 max_namespaces: int = MAX_NAMESPACES, idle_namespace_s: float = IDLE_NAMESPACE_S,
                 flush_timeout: float = FLUSH_TIMEOUT_S):
        self.socket_path = socket_path
        self.max_clients = max_clients
        self.lease_grace_s = lease_grace_s
        self.max_namespaces = max_namespaces
        self.idle_namespace_s = idle_namespace_s
        self.flush_timeout = flush_timeout
        self.namespaces: dict[str, Namespace] = {}
        self._lock = threading.Lock()  # namespaces (and their engine counts), closing, clients
        self._closed = threading.Condition(self._lock)  # a namespace finished closing
        self._closing: dict[str, threading.Thread] = {}  # namespace name -> the thread closing it
        self._clients: set[socket.socket] = set()
        self._stop = threading.Event()
        self._server = listen(socket_path)
        self._threads = [threading.Thread(target=self._accept_loop, name="kvtier-host-accept", daemon=True),
                         threading.Thread(target=self._heartbeat, name="kvtier-host-step", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("kvtier host owner (pid %d) listening on %s", os.getpid(), socket_path)

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # the listening socket was closed
            uid = peer_uid(conn)
            if uid != os.getuid():
                log.warning("kvtier host: refused a connection from another user (uid %d)", uid)
                conn.close()
                continue
            with self._lock:
                full = len(self._clients) >= self.max_clients
                if not full:
                    self._clients.add(conn)
            target, args = (_refuse, (conn, self.max_clients)) if full else (self._serve, (conn,))
            threading.Thread(target=target, args=args, name="kvtier-host-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one connection's requests in order until it closes or breaks the protocol."""
        reader, ledger = FrameReader(), Ledger()
        namespace: Namespace | None = None
        conn.settimeout(SEND_TIMEOUT_S)
        try:
            while not self._stop.is_set():
                try:
                    message = read_frame(conn, reader)
                except TimeoutError:
                    continue  # an idle engine; a partial frame stays in `reader`
                reply, namespace = self._answer(message, namespace, ledger)
                if not _answer(conn, reply):
                    break
        except (HostUnavailable, OSError) as exc:
            if isinstance(exc, FrameError):
                log.warning("kvtier host: closing a connection: %s", exc)
        finally:
            with self._lock:
                self._clients.discard(conn)
            conn.close()
            if namespace is not None:
                namespace.expire(ledger)
                with self._lock:
                    namespace.leave()

    def _answer(self, message: dict[str, Any], namespace: Namespace | None,
                ledger: Ledger) -> tuple[dict[str, Any], Namespace | None]:
        """The reply to `message` and the connection's namespace after it."""
        reply: dict[str, Any] = {"id": message.get("id")}
        op = message.get("op")
        try:
            if op == "hello":
                if namespace is not None:
                    raise ValueError("hello: this connection already said hello")
                namespace = self._namespace(message)
                reply.update(namespace=namespace.name, region=namespace.region, tier=namespace.tier,
                             owner_pid=os.getpid())
            elif op == "ping":
                reply["pong"] = True
            elif namespace is None:
                raise ValueError(f"{op}: say hello first")
            else:
                reply.update(namespace.call(str(op), message, ledger))
        except (ValueError, ConfigError) as exc:
            reply["error"] = str(exc)
        except Exception as exc:  # a bug or a failing tier must not take the owner down
            log.exception("kvtier host: %s failed", op)
            reply["error"] = f"{op} failed in the owner: {type(exc).__name__}: {exc}"
        return reply, namespace

    def _namespace(self, hello: dict[str, Any]) -> Namespace:
        """The namespace of the engine saying `hello` (counted among its engines), built at its
        identity's first engine (after the close of an idle one of the same identity)."""
        identity = Identity.parse(hello.get("identity"))
        name = identity.name()
        with self._lock:
            while name in self._closing and not self._stop.is_set():
                self._closed.wait(IDLE_CHECK_S)
            namespace = self.namespaces.get(name)
            if namespace is None:
                if len(self.namespaces) + len(self._closing) >= self.max_namespaces:
                    raise ValueError(f"hello: the owner serves at most {self.max_namespaces} model identities at "
                                     f"once (kvtier serve --max-namespaces); one is closed after "
                                     f"{self.idle_namespace_s:g} s without engines (--idle-namespace-s)")
                namespace = Namespace(identity, hello.get("config"), lease_grace_s=self.lease_grace_s)
                self.namespaces[name] = namespace
                log.info("kvtier host: namespace %s for %s (%d-byte blocks of %d tokens): tiers %s", name,
                         identity.model[:120], identity.block_bytes, identity.block_tokens,
                         ", ".join(t.name for t in namespace.config.tiers))
            else:
                namespace.check_same(hello.get("config"))
            namespace.engines += 1
            return namespace

    # ------------------------------------------------------------------ heartbeat and lifetime
    def _heartbeat(self) -> None:
        """Step every namespace each `STEP_S` while one is busy, each `IDLE_STEP_S` when none is."""
        period, checked = STEP_S, time.monotonic()
        while not self._stop.wait(period):
            with self._lock:
                namespaces = list(self.namespaces.values())
            busy = False
            for namespace in namespaces:
                try:
                    busy |= namespace.step()
                except Exception:
                    log.exception("kvtier host: stepping namespace %s failed", namespace.name)
            period = STEP_S if busy else IDLE_STEP_S
            if self.idle_namespace_s > 0 and time.monotonic() - checked >= IDLE_CHECK_S:
                checked = time.monotonic()
                self._close_idle()

    def _close_idle(self) -> None:
        """Close, each on a thread of its own, the namespaces unused for `idle_namespace_s`."""
        with self._lock:
            for namespace in list(self.namespaces.values()):
                if namespace.idle_s() >= self.idle_namespace_s:
                    del self.namespaces[namespace.name]
                    thread = threading.Thread(target=self._close_namespace, args=(namespace,),
                                              name="kvtier-host-close", daemon=True)
                    self._closing[namespace.name] = thread
                    thread.start()

    def _close_namespace(self, namespace: Namespace) -> None:
        try:
            left = namespace.close(self.flush_timeout)
            log.info("kvtier host: closed namespace %s after %g s without engines (%d block(s) not written below)",
                     namespace.name, self.idle_namespace_s, left)
        except Exception:
            log.exception("kvtier host: closing namespace %s failed", namespace.name)
        finally:
            with self._lock:
                del self._closing[namespace.name]
                self._closed.notify_all()

    def client_count(self) -> int:
        with self._lock:
            return len(self._clients)

    def close(self, flush_timeout: float | None = None) -> None:
        """Stop serving, write every namespace's dirty CPU blocks down (at most `flush_timeout` s
        each, default the owner's) and close the tiers. Idempotent."""
        flush_timeout = self.flush_timeout if flush_timeout is None else flush_timeout
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # (wakes the accept loop; close alone may not)
        except OSError:
            pass
        self._server.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        with self._lock:
            clients, namespaces = list(self._clients), list(self.namespaces.values())
            closing = list(self._closing.values())
        for conn in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # (wakes its thread's read)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)
        for thread in closing:  # (idle namespaces being closed)
            thread.join(timeout=flush_timeout + 5)
        for namespace in namespaces:
            left = namespace.close(flush_timeout)
            if left:
                log.warning("kvtier host: namespace %s: %d block(s) not written below before closing",
                            namespace.name, left)


def _refuse(conn: socket.socket, max_clients: int) -> None:
    """Tell an engine past `max_clients` so, in answer to its first request, and close."""
    conn.settimeout(SEND_TIMEOUT_S)
    try:
        first = read_frame(conn, FrameReader())
        _answer(conn, {"id": first.get("id"), "error": f"the owner serves at most {max_clients} engines at once"})
    except (HostUnavailable, OSError):
        pass
    finally:
        conn.close()


def _answer(conn: socket.socket, reply: dict[str, Any]) -> bool:
    """Send `reply`; False when the client cannot take it (gone, or not reading)."""
    try:
        conn.sendall(encode(reply))
        return True
    except OSError:  # (TimeoutError is one)
        return False
