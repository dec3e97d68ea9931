"""`config check --env` (`kvtier.tiers.remote.env.reach`) against hostile servers on 127.0.0.1: one that
answers byte by byte forever, one that answers another protocol, and a cluster url of many seeds
that each answer only once all of them are connected (so they must be asked at once, within the
one bound of the whole check), and one that echoes AUTH's arguments in its error (in the check and
under a built tier). Before, the first hung the check, the seeds were asked one by one and the
echoed password was printed, raised and logged."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvtier.core.errors import BlocksFailed

pytest.importorskip("redis")

from kvtier.tiers.remote.env import reach  # noqa: E402


class FakeServer:
    """A listening socket on 127.0.0.1 whose accepted connections are handed to `serve`."""

    def __init__(self, serve):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stopped = threading.Event()
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn):
        with conn:
            try:
                self._serve(conn, self.stopped)
            except OSError:
                pass

    def stop(self):
        self.stopped.set()
        self.sock.close()


def reach_with_password(serve, timeout_ms: int) -> list[tuple[str, str]]:
    """The problems `reach` finds on a server run by `serve`, with password `PASSWORD` (set in the
    environment by the `password` fixture)."""
    server = FakeServer(serve)
    try:
        notes, problems = reach({"url": f"redis://127.0.0.1:{server.port}", "timeout_ms": timeout_ms,
                                 "password_env": "KVT_HOSTILE_PW"})
    finally:
        server.stop()
    assert notes == []
    return problems


PASSWORD = "hostile-secret"


@pytest.fixture
def password(monkeypatch):
    monkeypatch.setenv("KVT_HOSTILE_PW", PASSWORD)


def trickle(conn, stopped):
    """A status reply that never ends: one byte every 50 ms (each read gets a byte in time), for 6 s."""
    conn.recv(4096)
    end = time.monotonic() + 6
    conn.sendall(b"+")
    while not stopped.is_set() and time.monotonic() < end:
        conn.sendall(b"P")
        time.sleep(0.05)


def test_a_server_answering_byte_by_byte_is_a_timeout_of_the_whole_check(password):
    (field, message), = reach_with_password(trickle, 200)
    assert field == "url" and "timeout: no complete answer within 4 x timeout_ms (800 ms)" in message
    assert PASSWORD not in message


def test_a_server_of_another_protocol_is_named_as_such():
    server = FakeServer(lambda conn, _stopped: (conn.recv(4096), conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")))
    try:
        _notes, problems = reach({"url": f"redis://127.0.0.1:{server.port}", "timeout_ms": 500})
    finally:
        server.stop()
    assert problems and problems[0][0] == "url"
    assert "the answer is not the Redis protocol (is a valkey server listening there?)" in problems[0][1]


def test_the_seeds_of_a_cluster_url_are_asked_at_once():
    seeds = 8
    barrier = threading.Barrier(seeds, timeout=5)

    def pong_once_all_are_connected(conn, _stopped):
        barrier.wait()  # raises BrokenBarrierError (the seed does not answer) if asked one by one
        while conn.recv(4096):
            conn.sendall(b"+PONG\r\n")

    servers = [FakeServer(pong_once_all_are_connected) for _ in range(seeds)]
    try:
        notes, problems = reach({"url": "cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers),
                                 "timeout_ms": 1000})
    finally:
        for server in servers:
            server.stop()
    assert problems == [] and notes == [f"cluster seed(s) {', '.join(f'127.0.0.1:{s.port}' for s in servers)} "
                                        f"answered PING"]


def echo_unknown_command(conn, _stopped):
    """Answer the first command as Redis answers one it does not know (AUTH renamed or disabled):
    an error that repeats its arguments, the password among them."""
    data = conn.recv(4096)
    if not data:
        raise ConnectionResetError("the client hung up")  # (an OSError: ends this connection quietly)
    words = [w for w in data.split(b"\r\n") if w and w[:1] not in b"*$"]
    conn.sendall(b"-ERR unknown command '%s', with args beginning with: %s\r\n"
                 % (words[0], b" ".join(b"'%s'" % w for w in words[1:])))


def test_a_server_echoing_the_auth_arguments_never_gets_the_password_printed(password):
    (field, message), = reach_with_password(echo_unknown_command, 500)
    assert PASSWORD not in message and "with args beginning with: <hidden>" in message
    assert field == "url" and "the server does not know a command sent" in message


def test_at_run_time_the_echoed_password_is_neither_raised_nor_logged(password, caplog):
    """The same server under a built valkey tier: before, the error of a read and the tier's
    WARNING quoted the password."""
    from kvtier import build_hierarchy, load_config_text, make_offload_key
    from kvtier.tiers.remote.errors import RemoteUnavailable

    def echo_each_connection(conn, stopped):
        while not stopped.is_set():
            echo_unknown_command(conn, stopped)

    server = FakeServer(echo_each_connection)
    h = build_hierarchy(load_config_text(
        "block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n  - {name: shared, "
        f"backend: valkey, capacity: 64 blocks, url: 'redis://127.0.0.1:{server.port}', password_env: "
        "KVT_HOSTILE_PW, timeout_ms: 500}\n"), model="hostile/echo")
    key = bytes(make_offload_key(b"k" * 16, 0))
    try:
        with caplog.at_level("WARNING", logger="kvtier.tiers.remote"):
            with pytest.raises(BlocksFailed) as info:  # (the read's blocks failed: its cause says why)
                h.manager.tiers[1].backend.get_blocks([key], [bytearray(4096)])
    finally:
        h.close()
        server.stop()
    assert isinstance(info.value.__cause__, RemoteUnavailable) and info.value.positions == (0,)
    assert PASSWORD not in str(info.value) and "with args beginning with: <hidden>" in str(info.value)
    assert "with args beginning with: <hidden>" in caplog.text and PASSWORD not in caplog.text


def test_the_breaker_opened_by_an_echoed_password_never_logs_or_reports_it(password, caplog):
    """Failures enough to open the circuit breaker, then its failed reconnect checks: its INFO line
    and the store's `reason` name the last error without the password (before, both quoted it as
    the server sent it)."""
    from kvtier.tiers.remote.backend import ValkeyBackend
    from kvtier.tiers.remote.errors import RemoteUnavailable

    def echo_each_connection(conn, stopped):
        while not stopped.is_set():
            echo_unknown_command(conn, stopped)

    server = FakeServer(echo_each_connection)
    tier = ValkeyBackend("shared", 64, 4096, url=f"redis://127.0.0.1:{server.port}", password_env="KVT_HOSTILE_PW",
                         timeout_ms=500, breaker_failures=2, breaker_open_s=0.05, fingerprint="hostile/echo",
                         layout="test")
    try:
        with caplog.at_level("INFO", logger="kvtier"):
            for _ in range(2):
                with pytest.raises(BlocksFailed) as info:
                    tier.get_blocks([b"k" * 20], [bytearray(4096)])
                assert isinstance(info.value.__cause__, RemoteUnavailable)
        store = tier.store  # built by the reads above
        reasons = [store.reason]
        breaker, = store.servers.breakers()
        end = time.monotonic() + 10
        while breaker.last_error.startswith("ResponseError") and time.monotonic() < end:
            time.sleep(0.02)  # until a reconnect check has failed (its error is the last one)
        reasons.append(store.reason)
    finally:
        tier.close()
        server.stop()
    assert "(last: ResponseError" in reasons[0] and "(last: ResponseError" not in reasons[1]  # the check's error
    for reason in reasons:
        assert "circuit breaker open" in reason and "with args beginning with: <hidden>" in reason
        assert PASSWORD not in reason
    assert "consecutive failures" in caplog.text and PASSWORD not in caplog.text
