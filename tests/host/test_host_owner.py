"""The host owner's socket and protocol: private to its user, bounded, and what a departed engine
held is released only after the grace period."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import struct
import tempfile
import time
import uuid

import pytest

from kvtier import make_offload_key
from kvtier.config.shared import SharedHost
from kvtier.host.client import HostClient, HostRefused
from kvtier.host.listener import OwnerRunning, UnsafeSocketPath
from kvtier.host.owner import HostOwner
from kvtier.host.wire import MAX_FRAME_BYTES, FrameReader, HostUnavailable, encode, hex_keys, read_frame


def keys(n, start=0):
    return [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(start, start + n)]


def hello(cpu_blocks=8):
    return {"identity": {"model": f"m-{uuid.uuid4().hex[:8]}", "block_bytes": 4096, "block_tokens": 16},
            "config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": f"{cpu_blocks} blocks"}]}}


@pytest.fixture
def owner(tmp_path):
    owner = HostOwner(str(tmp_path / "run" / "host.sock"), max_clients=4, lease_grace_s=0.3)
    yield owner
    owner.close(flush_timeout=5)


def client(owner, greeting=None, timeout_ms=2000):
    return HostClient(SharedHost(owner.socket_path, timeout_ms), greeting or hello())


def raw_connection(owner):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(owner.socket_path)
    return sock


def test_the_socket_is_0600_in_a_0700_directory(owner):
    assert stat.S_IMODE(os.stat(owner.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(owner.socket_path)).st_mode) == 0o700


def test_a_second_owner_on_the_same_path_is_refused(owner):
    with pytest.raises(OwnerRunning):
        HostOwner(owner.socket_path)


def test_a_directory_others_may_enter_is_refused(tmp_path):
    shared_dir = tmp_path / "open"
    shared_dir.mkdir(mode=0o755)
    os.chmod(shared_dir, 0o755)
    with pytest.raises(UnsafeSocketPath, match="mode 755"):
        HostOwner(str(shared_dir / "host.sock"))


def test_a_socket_directory_whose_parent_is_missing_is_named(tmp_path, capsys):
    """Before: `kvtier serve --socket` under a missing folder ended in a FileNotFoundError traceback."""
    from kvtier.cli.main import main

    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert main(["serve", "--socket", str(tmp_path / "no" / "run" / "host.sock")]) == 2
    err = capsys.readouterr().err
    assert f"cannot create {tmp_path / 'no' / 'run'}" in err and "Traceback" not in err
    # (a refused start leaves this process's signal handlers as they were: a fork test after it
    # expects a child to die of SIGTERM)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_a_file_that_is_not_a_socket_is_left_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "host.sock").write_text("mine")
    with pytest.raises(UnsafeSocketPath, match="not a socket"):
        HostOwner(str(run / "host.sock"))
    assert (run / "host.sock").read_text() == "mine"


def test_a_socket_left_by_a_dead_owner_is_replaced(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(run / "host.sock"))
    stale.close()  # (bound, never listening: what a killed owner leaves)
    owner = HostOwner(str(run / "host.sock"))
    try:
        assert client(owner).connect()["num_blocks"] == 8
    finally:
        owner.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_refused_even_when_the_file_modes_let_it_in():
    top = tempfile.mkdtemp(prefix="kvtier-peer-", dir="/tmp")
    owner = HostOwner(os.path.join(top, "run", "host.sock"))
    try:
        for path, mode in ((top, 0o755), (os.path.dirname(owner.socket_path), 0o755), (owner.socket_path, 0o666)):
            os.chmod(path, mode)  # (what a careless admin could do: only the peer check is left)
        pid = os.fork()
        if pid == 0:  # the child: another user
            code = 1
            try:
                os.setuid(65534)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5)
                sock.connect(owner.socket_path)  # (an error here fails the test: code 1)
                try:
                    sock.sendall(encode({"id": 1, "op": "ping"}))
                    code = 0 if sock.recv(100) == b"" else 3  # closed without an answer
                except (BrokenPipeError, ConnectionResetError):
                    code = 0  # closed (before or while it wrote)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client(owner).call("ping")["pong"] is True  # (its own user is still served)
    finally:
        owner.close()
        shutil.rmtree(top, ignore_errors=True)


def test_an_oversized_or_garbled_frame_closes_only_that_connection(owner):
    for payload in (struct.pack(">I", MAX_FRAME_BYTES + 1), struct.pack(">I", 5) + b"nope!",
                    struct.pack(">I", 2) + b"[]"):
        sock = raw_connection(owner)
        sock.sendall(payload)
        assert sock.recv(100) == b""  # closed
        sock.close()
    assert client(owner).call("ping")["pong"] is True


def test_bad_requests_are_answered_with_an_error_naming_the_field(owner):
    sock, reader = raw_connection(owner), FrameReader()

    def ask(message):
        sock.sendall(encode(message))
        return read_frame(sock, reader)

    assert "say hello first" in ask({"id": 1, "op": "lookup_run", "keys": []})["error"]
    assert "identity" in ask({"id": 2, "op": "hello", "identity": "x"})["error"]
    assert "namespace" in ask({"id": 3, "op": "hello", **hello()})
    assert "keys" in ask({"id": 4, "op": "lookup_run", "keys": ["zz"]})["error"]
    assert "unknown operation" in ask({"id": 5, "op": "drop_all"})["error"]
    assert "already said hello" in ask({"id": 6, "op": "hello", **hello()})["error"]
    sock.close()


def test_a_bad_config_is_refused_at_hello_with_the_field(owner):
    greeting = hello()
    greeting["config"]["tiers"][0]["capacity"] = "many"
    with pytest.raises(HostRefused, match=r"tiers\[0\]\.capacity"):
        client(owner, greeting).connect()


def test_engines_past_max_clients_are_told_and_the_others_served(owner):
    greeting = hello()
    clients = [client(owner, greeting) for _ in range(4)]
    for c in clients:
        c.connect()
    with pytest.raises(HostRefused, match="at most 4 engines"):
        client(owner, greeting).connect()
    assert clients[0].call("lookup_run", keys=[])["hits"] == 0


def test_a_departed_engines_pins_and_unfinished_stores_are_released_after_the_grace(owner):
    greeting = hello(cpu_blocks=4)
    a, b = client(owner, greeting), client(owner, greeting)
    stored = a.call("prepare_store", keys=hex_keys(keys(2)))
    a.call("complete_store", keys=stored["store"], success=True)
    assert a.call("prepare_load", keys=hex_keys(keys(2)))["slots"]  # pinned by a
    assert a.call("prepare_store", keys=hex_keys(keys(2, start=10)))["room"]  # written by a, never completed
    a.close()
    # Within the grace, a's slots are as it left them: the tier (4 blocks) has no room for 4 more.
    assert b.call("prepare_store", keys=hex_keys(keys(4, start=20)))["room"] is False
    time.sleep(0.6)
    assert b.call("lookup_run", keys=hex_keys(keys(1, start=10)))["hits"] == 0  # never made readable
    assert b.call("prepare_store", keys=hex_keys(keys(4, start=20)))["room"] is True


def test_complete_calls_release_only_what_this_connection_holds(owner):
    greeting = hello(cpu_blocks=4)
    a, b = client(owner, greeting), client(owner, greeting)
    stored = a.call("prepare_store", keys=hex_keys(keys(2)))
    assert b.call("complete_store", keys=stored["store"], success=True)["completed"] == 0
    assert b.call("lookup_run", keys=stored["store"])["hits"] == 0  # still a's, still being written
    a.call("complete_store", keys=stored["store"], success=True)
    a.call("prepare_load", keys=stored["store"])
    assert b.call("complete_load", keys=stored["store"])["released"] == 0
    assert a.call("complete_load", keys=stored["store"])["released"] == 2


def test_keys_the_tiers_cannot_hold_are_refused_before_anything_changes(owner):
    c = client(owner)
    for bad in (b"", b"k" * 70000):
        with pytest.raises(HostRefused, match=r"keys\[1\]: \d+ bytes; a key has 1 to \d+ bytes"):
            c.call("prepare_store", keys=hex_keys([keys(1)[0], bad]))
    assert c.call("lookup_run", keys=hex_keys(keys(1)))["hits"] == 0
    assert c.call("prepare_store", keys=hex_keys(keys(1)))["room"] is True


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to listen as another user")
def test_an_engine_never_talks_to_a_socket_another_user_serves():
    top = tempfile.mkdtemp(prefix="kvtier-fake-", dir="/tmp")
    os.chmod(top, 0o777)
    path = os.path.join(top, "host.sock")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user's fake owner, answering every request
        try:
            os.setuid(65534)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(path)
            server.listen(1)
            os.write(ready_w, b"x")
            conn, _ = server.accept()
            conn.settimeout(5)
            message = read_frame(conn, FrameReader())
            conn.sendall(encode({"id": message.get("id"), "namespace": "x", "tier": "cpu", "region": {}}))
            time.sleep(1)
        finally:
            os._exit(0)
    try:
        os.read(ready_r, 1)
        with pytest.raises(HostUnavailable, match="served by uid 65534, not by this user"):
            HostClient(SharedHost(path, 2000), hello()).connect()
    finally:
        os.waitpid(pid, 0)
        shutil.rmtree(top, ignore_errors=True)


def test_a_key_named_twice_releases_only_the_pins_this_connection_holds(owner):
    greeting = hello(cpu_blocks=4)
    a, b = client(owner, greeting), client(owner, greeting)
    key = hex_keys(keys(1))
    a.call("complete_store", keys=a.call("prepare_store", keys=key)["store"], success=True)
    a.call("prepare_load", keys=key)
    b.call("prepare_load", keys=key)
    assert a.call("complete_load", keys=key * 2)["released"] == 1
    (namespace,) = owner.namespaces.values()
    assert namespace.manager.tiers[0].table.get(keys(1)[0]).ref_cnt == 1  # b's pin holds
