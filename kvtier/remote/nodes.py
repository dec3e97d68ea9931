"""One server's connections: a pool for values and a pool for probes, with no client retries.

Commands are packed here and sent on a pooled redis-py connection (hiredis parses replies): a SET
sends the caller's block buffer and the trailer as one value without joining them (no copy of the
block), a GET of a block (`get_into`) receives the value's payload straight from the socket into
the caller's buffer (no reply object, no copy: hiredis would copy it twice and the caller once
more), and a probe is one write of N `EXISTS` commands and N replies read back (one round trip).
Probes and PINGs use their own pool, so they never wait behind a MiB reply on a data connection.

Every socket operation is bounded by `ClientOptions.timeout_s` (`connect_timeout_s` for connecting)
and nothing is retried: redis-py's `Retry(NoBackoff(), 0)`. A connection that failed mid-command is
closed, never returned to the pool with a reply still pending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.remote.options import ClientOptions, Endpoint


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


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _read_bulk_into(sock: Any, out: memoryview, tail: int) -> tuple[tuple[int, bytes] | None, bool]:
    """Read one reply to a GET from `sock` (see `NodeClient.get_into`); `(result, clean)`, clean
    when the whole reply was read. Raises an error reply as its redis-py exception."""
    head = bytearray()
    while b"\r\n" not in head:
        if len(head) > 4096:
            raise redis.ConnectionError("GET reply: no end of line in its first 4 KiB")
        chunk = sock.recv(4096)
        if not chunk:
            raise redis.ConnectionError("GET reply: the server closed the connection")
        head += chunk
    line, _, rest = bytes(head).partition(b"\r\n")
    kind, text = line[:1], line[1:]
    if kind == b"-":
        if rest:
            raise redis.ConnectionError("GET reply: bytes after an error reply")
        raise BaseParser.parse_error(text.decode("utf-8", "replace"))
    if kind not in (b"$", b"_") or (kind == b"$" and not text.lstrip(b"-").isdigit()):
        raise redis.ConnectionError(f"GET reply: unexpected {line[:32]!r}")
    length = -1 if kind == b"_" else int(text)
    if length < 0:  # nil (RESP2 $-1, RESP3 _)
        return None, not rest
    size = out.nbytes
    if length != size + tail:
        return (length, b""), False
    got = min(len(rest), size)
    out[:got] = rest[:got]
    rest = rest[got:]
    while got < size:
        n = sock.recv_into(out[got:])
        if not n:
            raise redis.ConnectionError("GET reply: the server closed the connection")
        got += n
    end = bytearray(rest)
    while len(end) < tail + 2:
        chunk = sock.recv(tail + 2 - len(end))
        if not chunk:
            raise redis.ConnectionError("GET reply: the server closed the connection")
        end += chunk
    if len(end) != tail + 2 or not end.endswith(b"\r\n"):
        raise redis.ConnectionError("GET reply: the value does not end where its length says")
    return (length, bytes(end[:tail])), True


@dataclass
class PendingExists:
    """A probe sent to one server whose replies are not read yet."""

    conn: Any
    count: int


class NodeClient:
    """The connections to one server. Thread-safe (redis-py pools are)."""

    def __init__(self, options: ClientOptions, endpoint: Endpoint, *, tls: bool, db: int = 0):
        self.name = endpoint.name
        kwargs = connection_kwargs(options, tls)
        kwargs["db"] = db
        if endpoint.unix_path:
            kwargs["connection_class"] = redis.UnixDomainSocketConnection
            kwargs["path"] = endpoint.unix_path
            kwargs.pop("socket_keepalive")  # TCP only
        else:
            kwargs.update(host=endpoint.host, port=endpoint.port)
            if tls:
                kwargs["connection_class"] = redis.SSLConnection
        self._data = redis.ConnectionPool(**kwargs)
        self._probe = redis.ConnectionPool(**kwargs)

    def _roundtrip(self, pool: redis.ConnectionPool, packed: Sequence[bytes | memoryview], replies: int) -> list:
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed, check_health=False)
            if replies == 1:
                return [conn.read_response(disable_decoding=True)]
            out = []
            for _ in range(replies):  # an error reply does not stop the others from being read
                try:
                    out.append(conn.read_response(disable_decoding=True))
                except redis.ResponseError as exc:
                    out.append(exc)
            return out
        except redis.ResponseError:
            raise  # the one reply was read: the connection is clean
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def set_value(self, key: bytes, payload: memoryview, trailer: bytes) -> None:
        """SET key = payload || trailer, sending `payload` as it is."""
        head = b"*3\r\n$3\r\nSET\r\n" + _bulk(key) + b"$%d\r\n" % (payload.nbytes + len(trailer))
        self._roundtrip(self._data, [head, payload, trailer + b"\r\n"], 1)

    def get(self, key: bytes) -> bytes | None:
        return self._roundtrip(self._data, [b"*2\r\n$3\r\nGET\r\n" + _bulk(key)], 1)[0]

    def get_into(self, key: bytes, out: memoryview, tail: int) -> tuple[int, bytes] | None:
        """GET `key` into `out` (writable bytes): None when the key is missing; else `(value length,
        trailer)`. When the value is `out.nbytes + tail` bytes long its first `out.nbytes` bytes are
        received straight into `out` and `trailer` is the last `tail`; any other length is not read
        (the connection is closed: nothing stays pending on it) and `trailer` is empty. An error
        reply raises it as redis-py would (e.g. `NoPermissionError`); a socket timeout raises
        `redis.TimeoutError`. `out` may be partly written when this raises."""
        conn = self._data.get_connection()
        clean = False
        try:
            conn.send_packed_command([b"*2\r\n$3\r\nGET\r\n" + _bulk(key)], check_health=False)
            result, clean = _read_bulk_into(conn._sock, out, tail)
            return result
        except TimeoutError:  # socket.timeout
            raise redis.TimeoutError(f"Timeout reading from {self.name}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error reading from {self.name}: {exc}") from None
        finally:
            if not clean:
                conn.disconnect()
            self._data.release(conn)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` exist: one write, one round trip, on a probe connection. An error reply
        (e.g. an ACL refusal) raises it."""
        return self.exists_finish(self.exists_send(keys))

    def exists_send(self, keys: Sequence[bytes]) -> PendingExists:
        """First half of `exists`: the commands are sent, the replies not read yet, so several servers
        work on their probes at once. Pass the result to `exists_finish`, always (it frees the connection)."""
        conn = self._probe.get_connection()
        try:
            conn.send_packed_command([b"".join(b"*2\r\n$6\r\nEXISTS\r\n" + _bulk(k) for k in keys)],
                                     check_health=False)
        except BaseException:
            conn.disconnect()  # send_packed_command already closed it on socket errors
            self._probe.release(conn)
            raise
        return PendingExists(conn, len(keys))

    def exists_finish(self, pending: PendingExists) -> list[bool]:
        """Second half of `exists`: read the replies of `exists_send`."""
        conn, replies = pending.conn, []
        try:
            for _ in range(pending.count):  # an error reply does not stop the others from being read
                try:
                    replies.append(conn.read_response(disable_decoding=True))
                except redis.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._probe.release(conn)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [bool(r) for r in replies]

    def exists_abandon(self, pending: PendingExists) -> None:
        """Drop a sent probe without reading it (its connection is closed, never reused)."""
        pending.conn.disconnect()
        self._probe.release(pending.conn)

    def ping(self) -> None:
        self._roundtrip(self._probe, [b"*1\r\n$4\r\nPING\r\n"], 1)

    def close(self) -> None:
        self._data.disconnect()
        self._probe.disconnect()
