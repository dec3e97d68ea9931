"""One server's connections: a pool for values and a pool for probes, with no client retries.

Commands are packed here and sent on a pooled redis-py connection (hiredis parses replies): a SET
sends the caller's block buffer and the trailer as one value without joining them (no copy of the
block), and a probe is one write of N `EXISTS` commands and N replies read back (one round trip).
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
