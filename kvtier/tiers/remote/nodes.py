"""One server's connections: a pool for values and a pool for probes, with no client retries.

Commands are packed here and sent on a pooled redis-py connection; replies are read here (`_Reply`),
not by redis-py: a SET sends the caller's block buffer and the trailer as one value without joining
them (no copy of the block), a GET of a block (`get_into`) receives the value's payload straight
from the socket into the caller's buffer (no reply object, no copy), and a probe is one write of N
`EXISTS` commands and N replies read back (one round trip). Probes and PINGs use their own pool, so
they never wait behind a MiB reply on a data connection.

**One deadline per operation.** Every call takes `deadline`, a `time.monotonic()` value (default:
`ClientOptions.timeout_s` from the call): connecting (and the handshake) and every send and receive
of the operation get only the time left until it, so a server that answers one byte at a time
cannot stretch an operation past it; past it the call raises `redis.TimeoutError`. Nothing is
retried (redis-py's `Retry(NoBackoff(), 0)`). A connection that failed mid-command is closed, never
returned to the pool with a reply still pending.

**A server that requires a password.** Without one (no AUTH sent), a server that requires one answers
`NOAUTH`, and refuses a value over 16 KiB with `-ERR Protocol error: unauthenticated bulk length`,
then closes the connection, often while the value is still being sent (a broken pipe). Both are
raised as `redis.AuthenticationError` (`server_error`; `_send` reads what the server said before it
closed), never as a protocol or connection error.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.url import Endpoint

MAX_LINE = 64 * 1024  # the longest reply line read (an error message): a server sending more is broken
_DEADLINE = threading.local()  # the deadline of the operation this thread runs (read by `_Bounded`)


def connection_kwargs(options: ClientOptions, tls: bool) -> dict:
    """redis-py connection arguments shared by every server of `options` (no host, port or path)."""
    kwargs: dict = {
        "username": options.username, "password": options.password,
        "socket_timeout": options.timeout_s, "socket_connect_timeout": options.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0), "health_check_interval": 0,
        "socket_keepalive": True, "driver_info": None,  # no CLIENT SETINFO round trips on connect
    }
    if not tls:
        # RESP2: a new plain connection (e.g. after a timeout closed one) starts with no handshake round
        # trip (redis-py 8 sends HELLO 3 and waits for it). Not over TLS: there, without HELLO, the pool
        # found unread bytes on fresh connections and refused them ("Connection has data"; TLS 1.3
        # session tickets, presumably), so TLS keeps redis-py's handshake.
        kwargs["protocol"] = 2
    else:
        kwargs.update(ssl_ca_certs=options.tls_ca_file, ssl_certfile=options.tls_cert_file,
                      ssl_keyfile=options.tls_key_file, ssl_cert_reqs="required" if options.tls_verify else "none",
                      ssl_check_hostname=options.tls_verify)
    return kwargs


def time_left(deadline: float, what: str) -> float:
    """Seconds until `deadline`; `redis.TimeoutError` naming `what` when none are left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise redis.TimeoutError(f"{what}: the operation's deadline passed")
    return left


def _bounded(base: type) -> type:
    """`base` (a redis-py connection class) whose connect and handshake take at most the time left
    until the calling thread's operation deadline (`_DEADLINE.at`), and at most the configured
    timeouts."""

    class Bounded(base):
        def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
            if self._sock is None:
                conn: Any = self
                limits = conn.__dict__.setdefault("_kvt_limits", (conn.socket_connect_timeout, conn.socket_timeout))
                at = getattr(_DEADLINE, "at", None)
                left = limits[1] if at is None else time_left(at, "connect")
                self.socket_connect_timeout = min(limits[0], left)
                self.socket_timeout = min(limits[1], left)
            super().connect_check_health(*args, **kwargs)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


_CLASSES: dict[type, type] = {
    cls: _bounded(cls) for cls in (redis.Connection, redis.UnixDomainSocketConnection, redis.SSLConnection)}


_UNAUTHENTICATED = "Protocol error: unauthenticated"  # how Redis/Valkey refuse a large command before AUTH


def server_error(text: str) -> Exception:
    """The redis-py exception of the error reply `text` (without its leading `-`), as redis-py
    raises it (`NOAUTH` / `WRONGPASS`: `redis.AuthenticationError`, `NOPERM`: `NoPermissionError`,
    ...), and `redis.AuthenticationError` for the refusal of a command too large for a client that
    has not authenticated (module docstring): that server requires a password."""
    error = BaseParser.parse_error(text)
    if type(error) is redis.ResponseError and str(error).startswith(_UNAUTHENTICATED):
        return redis.AuthenticationError(f"Authentication required. ({error}, to a command sent before AUTH)")
    return error


def _said_before_closing(sock: Any) -> Exception | None:
    """The error reply a server sent on `sock` before closing it (a send to it failed), as
    `server_error` raises it; None when nothing (or no error reply) has arrived. Does not wait."""
    try:
        sock.settimeout(0)
        data = sock.recv(MAX_LINE)
    except (OSError, ValueError):  # nothing arrived (BlockingIOError, SSLWantReadError), reset, closed
        return None
    end = data.find(b"\r\n")
    return server_error(data[1:end].decode("utf-8", "replace")) if data[:1] == b"-" and end > 0 else None


def _send_all(conn: Any, packed: Sequence[bytes | memoryview], name: str) -> None:
    """Send `packed` on `conn`'s socket (its timeout set by the caller): a timeout raises
    `redis.TimeoutError`; a failed send raises the error reply the server sent before closing the
    connection when there is one (e.g. an authentication refusal), else `redis.ConnectionError`."""
    sock = conn._sock
    try:
        for item in packed:
            sock.sendall(item)
    except TimeoutError:  # socket.timeout
        raise redis.TimeoutError(f"Timeout writing to {name}") from None
    except OSError as exc:
        said = _said_before_closing(sock)
        if said is not None:
            raise said from None
        raise redis.ConnectionError(f"Error writing to {name}: {exc}") from None


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class _Reply:
    """RESP replies read from one socket, every receive bounded by the time left until `deadline`."""

    def __init__(self, sock: Any, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray()

    def _recv(self, call: Any, *args: Any) -> Any:
        """`call(*args)` (a receive) waiting at most until the deadline; past it, only bytes that
        already arrived are taken (a reply that came in time is not lost to a slow sibling's wait)."""
        left = self.deadline - time.monotonic()
        self.sock.settimeout(max(left, 0.0))
        try:
            return call(*args)
        except (BlockingIOError, ssl.SSLWantReadError):  # (timeout 0: nothing has arrived)
            raise redis.TimeoutError("reply: the operation's deadline passed") from None

    def _more(self) -> None:
        chunk = self._recv(self.sock.recv, 4096)  # (small: a value's payload goes straight to `into`)
        if not chunk:
            raise redis.ConnectionError("the server closed the connection mid-reply")
        self.buf += chunk

    def line(self) -> bytes:
        """The next reply line, without its CRLF."""
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_LINE:
                raise redis.ConnectionError(f"reply: no end of line in its first {MAX_LINE} bytes")
            self._more()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        return line

    def simple(self) -> bytes | int | Exception | None:
        """One reply that is not a bulk string: `+text` (bytes), `:n` (int), nil (None); an error
        reply is returned as its redis-py exception (`ResponseError` and subclasses)."""
        line = self.line()
        kind, text = line[:1], line[1:]
        if kind == b"-":
            return server_error(text.decode("utf-8", "replace"))
        if kind == b"+":
            return text
        if kind == b":" and text.lstrip(b"-").isdigit():
            return int(text)
        if line in (b"$-1", b"_"):
            return None
        raise redis.ConnectionError(f"reply: unexpected {line[:32]!r}")

    def into(self, out: memoryview) -> None:
        """Fill `out` with the next `out.nbytes` bytes of the stream."""
        got = min(len(self.buf), out.nbytes)
        out[:got] = self.buf[:got]
        del self.buf[:got]
        while got < out.nbytes:
            n = self._recv(self.sock.recv_into, out[got:])
            if not n:
                raise redis.ConnectionError("the server closed the connection mid-reply")
            got += n

    def exact(self, n: int) -> bytes:
        """The next `n` bytes of the stream."""
        while len(self.buf) < n:
            chunk = self._recv(self.sock.recv, n - len(self.buf))
            if not chunk:
                raise redis.ConnectionError("the server closed the connection mid-reply")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _read_bulk_into(reply: _Reply, out: memoryview, tail: int) -> tuple[tuple[int, bytes] | None, bool]:
    """Read one reply to a GET (see `NodeClient.get_into`); `(result, clean)`, clean when the whole
    reply was read. Raises an error reply as its redis-py exception."""
    line = reply.line()
    kind, text = line[:1], line[1:]
    if kind == b"-":
        if reply.buf:
            raise redis.ConnectionError("GET reply: bytes after an error reply")
        raise server_error(text.decode("utf-8", "replace"))
    if kind not in (b"$", b"_") or (kind == b"$" and not text.lstrip(b"-").isdigit()):
        raise redis.ConnectionError(f"GET reply: unexpected {line[:32]!r}")
    length = -1 if kind == b"_" else int(text)
    if length < 0:  # nil (RESP2 $-1, RESP3 _)
        return None, not reply.buf
    if length != out.nbytes + tail:
        return (length, b""), False
    reply.into(out)
    end = reply.exact(tail + 2)
    if not end.endswith(b"\r\n"):
        raise redis.ConnectionError("GET reply: the value does not end where its length says")
    return (length, end[:tail]), not reply.buf


@dataclass
class PendingExists:
    """A probe sent to one server whose replies are not read yet."""

    conn: Any
    count: int
    deadline: float


class NodeClient:
    """The connections to one server. Thread-safe (redis-py pools are)."""

    def __init__(self, options: ClientOptions, endpoint: Endpoint, *, tls: bool, db: int = 0):
        self.name = endpoint.name
        self.timeout_s = options.timeout_s
        kwargs = connection_kwargs(options, tls)
        kwargs["db"] = db
        if endpoint.unix_path:
            base: type = redis.UnixDomainSocketConnection
            kwargs["path"] = endpoint.unix_path
            kwargs.pop("socket_keepalive")  # TCP only
        else:
            base = redis.SSLConnection if tls else redis.Connection
            kwargs.update(host=endpoint.host, port=endpoint.port)
        kwargs["connection_class"] = _CLASSES[base]
        self._data = redis.ConnectionPool(**kwargs)
        self._probe = redis.ConnectionPool(**kwargs)

    def _send(self, pool: redis.ConnectionPool, packed: Sequence[bytes | memoryview], deadline: float) -> Any:
        """A connection of `pool` (connected by `deadline`) with `packed` sent on it (by `deadline`)."""
        _DEADLINE.at = deadline
        try:
            conn: Any = pool.get_connection()  # (released by the pool itself when connecting fails)
        finally:
            _DEADLINE.at = None
        try:
            conn._sock.settimeout(time_left(deadline, f"send to {self.name}"))
            _send_all(conn, packed, self.name)
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        return conn

    def _exchange(self, pool: redis.ConnectionPool, packed: Sequence[bytes | memoryview], deadline: float | None,
                  read: Any) -> Any:
        """Send `packed` and return `read(reply)`'s result, all by `deadline` (default: `timeout_s`
        from now). `read` returns `(result, clean)`; a connection not read cleanly is closed. A
        result that is an error reply is raised."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        result = self._receive(pool, self._send(pool, packed, deadline), deadline, read)
        if isinstance(result, Exception):
            raise result
        return result

    def _receive(self, pool: Any, conn: Any, deadline: float, read: Callable[[_Reply], tuple[Any, bool]]) -> Any:
        """`read(reply)`'s result from `conn` (of `pool`) by `deadline`, as redis-py's errors; the
        connection goes back to `pool`, closed first unless `read` says it was read cleanly."""
        clean = False
        try:
            result, clean = read(_Reply(conn._sock, deadline))
        except TimeoutError:  # socket.timeout
            raise redis.TimeoutError(f"Timeout reading from {self.name}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error reading from {self.name}: {exc}") from None
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)
        return result

    def set_value(self, key: bytes, payload: memoryview, trailer: bytes, deadline: float | None = None) -> None:
        """SET key = payload || trailer, sending `payload` as it is."""
        head = b"*3\r\n$3\r\nSET\r\n" + _bulk(key) + b"$%d\r\n" % (payload.nbytes + len(trailer))
        self._exchange(self._data, [head, payload, trailer + b"\r\n"], deadline,
                       lambda reply: (reply.simple(), not reply.buf))

    def get_into(self, key: bytes, out: memoryview, tail: int, deadline: float | None = None
                 ) -> tuple[int, bytes] | None:
        """GET `key` into `out` (writable bytes) by `deadline`: None when the key is missing; else
        `(value length, trailer)`. When the value is `out.nbytes + tail` bytes long its first
        `out.nbytes` bytes are received straight into `out` and `trailer` is the last `tail`; any
        other length is not read (the connection is closed: nothing stays pending on it) and
        `trailer` is empty. An error reply raises it as redis-py would (e.g. `NoPermissionError`);
        the deadline passing raises `redis.TimeoutError`. `out` may be partly written when this raises."""
        return self._exchange(self._data, [b"*2\r\n$3\r\nGET\r\n" + _bulk(key)], deadline,
                              lambda reply: _read_bulk_into(reply, out, tail))

    def exists(self, keys: Sequence[bytes], deadline: float | None = None) -> list[bool]:
        """Which of `keys` exist: one write, one round trip, on a probe connection. An error reply
        (e.g. an ACL refusal) raises it."""
        return self.exists_finish(self.exists_send(keys, deadline))

    def exists_send(self, keys: Sequence[bytes], deadline: float | None = None) -> PendingExists:
        """First half of `exists`: the commands are sent, the replies not read yet, so several servers
        work on their probes at once. Pass the result to `exists_finish`, always (it frees the connection)."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        packed = [b"".join(b"*2\r\n$6\r\nEXISTS\r\n" + _bulk(k) for k in keys)]
        return PendingExists(self._send(self._probe, packed, deadline), len(keys), deadline)

    def exists_finish(self, pending: PendingExists) -> list[bool]:
        """Second half of `exists`: read the replies of `exists_send` (by its deadline)."""
        def read_all(reply: _Reply) -> tuple[list[Any], bool]:  # an error reply does not stop the others
            return [reply.simple() for _ in range(pending.count)], not reply.buf

        replies = self._receive(self._probe, pending.conn, pending.deadline, read_all)
        for one in replies:
            if isinstance(one, Exception):
                raise one
            if not isinstance(one, int):
                raise redis.ConnectionError(f"EXISTS reply: expected an integer, got {one!r:.32}")
        return [bool(r) for r in replies]

    def exists_abandon(self, pending: PendingExists) -> None:
        """Drop a sent probe without reading it (its connection is closed, never reused)."""
        pending.conn.disconnect()
        self._probe.release(pending.conn)

    def ask(self, commands: Sequence[Sequence[bytes]], deadline: float | None = None) -> list[Any]:
        """Send `commands` (each a command's arguments) in one write on a probe connection and read
        their replies by `deadline`, each as `_Reply.simple` reads it: status (bytes), integer, nil
        (None), or an error reply as its redis-py exception, returned, not raised. Only for commands
        answered so: a bulk string or an array reply raises `redis.ConnectionError`."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        packed = b"".join(b"*%d\r\n" % len(args) + b"".join(map(_bulk, args)) for args in commands)
        conn = self._send(self._probe, [packed], deadline)
        return self._receive(self._probe, conn, deadline,
                             lambda reply: ([reply.simple() for _ in commands], not reply.buf))

    def ping(self, deadline: float | None = None) -> None:
        self._exchange(self._probe, [b"*1\r\n$4\r\nPING\r\n"], deadline, lambda reply: (reply.simple(), not reply.buf))

    def close(self) -> None:
        """Close every connection, those in use too: a thread blocked reading one gets an error at once."""
        self._data.disconnect()
        self._probe.disconnect()
