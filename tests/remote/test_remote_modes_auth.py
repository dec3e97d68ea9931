"""A valkey tier's url in the wrong cluster mode, and a server that requires a password, on real servers.

`kvtier config check --env` fails (exit 2, on `url`) for a `cluster://` url whose server is not in
cluster mode and for a `redis://` url aimed at a cluster node, naming the server and the url to use;
before, the first passed (the tier then never loads a slot map: every call a miss) and the second
passed or failed depending on which node held the check's key (`cannot connect (MovedError ...)`).

A server that requires a password, given none: a write of a real block (over 16 KiB) is answered
`Protocol error: unauthenticated bulk length` and the connection closed, often mid-send; before, the
tier's WARNING named that protocol error or a broken pipe. Now every refusal (none, a wrong one, a
cluster's slot map) says that the server requires a password or refused it and how to give it
(password_env / password_file), never showing it.
"""

from __future__ import annotations

import logging
import os

import pytest
from remote.servers import start_server
from test_config_env import check  # config check FILE FLAGS -> (exit status, stdout, stderr)

from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.backend import ValkeyBackend
from kvtier.tiers.remote.errors import RemoteUnavailable

BIG = 64 * 1024  # a block larger than the 16 KiB a server accepts in one value before AUTH
PASSWORD = "modes-auth-" + os.urandom(6).hex()


def tier_yaml(url: str, extra: str = "") -> str:
    return ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: shared, backend: valkey, capacity: 64 blocks, url: '{url}', timeout_ms: 1000{extra}}}\n")


def env_check(tmp_path, capsys, url: str, extra: str = "") -> tuple[int, str, str]:
    return check(tmp_path, tier_yaml(url, extra), capsys, "--env")


# -- A: the url's cluster mode is checked -----------------------------------------------------------

def test_a_cluster_url_on_a_server_not_in_cluster_mode_fails_the_check(valkey_server, tmp_path, capsys):
    code, out, err = env_check(tmp_path, capsys, f"cluster://{valkey_server.name}")
    assert code == 2, out + err
    assert f"tiers[1].url: server {valkey_server.name}: not in cluster mode" in err
    assert f"use redis://{valkey_server.name}" in err and "name the nodes of a cluster" in err


def test_a_non_cluster_seed_fails_the_check_even_when_the_cluster_answers(valkey_cluster, valkey_server,
                                                                          tmp_path, capsys):
    code, out, err = env_check(tmp_path, capsys, f"{valkey_cluster.url},{valkey_server.name}")
    assert code == 2, out + err
    assert f"tiers[1].url: server {valkey_server.name}: not in cluster mode" in err
    assert f"server {valkey_cluster.servers[0].name}" not in err  # the cluster's own seeds are fine


def test_a_redis_url_on_any_cluster_node_fails_the_check(valkey_cluster, tmp_path, capsys):
    """Every node (before, the node holding the check's key passed and the others failed with a bare
    MovedError)."""
    for node in valkey_cluster.servers:
        code, out, err = env_check(tmp_path, capsys, node.url)
        assert code == 2, f"{node.name}: {out}{err}"
        assert f"tiers[1].url: server {node.name}: in cluster mode" in err
        assert f"use cluster://{node.name}" in err and "MOVED" in err


def test_the_right_urls_still_pass(valkey_cluster, valkey_server, tmp_path, capsys):
    assert env_check(tmp_path, capsys, valkey_cluster.url)[0] == 0
    code, out, err = env_check(tmp_path, capsys, valkey_server.url)
    assert code == 0 and f"{valkey_server.name} answered PING and EXISTS" in out, err


def test_a_tier_on_a_server_not_in_cluster_mode_says_so(valkey_server, make_store):
    store = make_store(f"cluster://{valkey_server.name}", wait=False)
    assert not store.wait_ready(3.0)
    assert "Cluster mode is not enabled" in store.reason and "for one server use redis://" in store.reason


# -- B: a server that requires a password -----------------------------------------------------------

@pytest.fixture
def password_server(tmp_path):
    server = start_server(tmp_path / "pw")
    server.client().config_set("requirepass", PASSWORD)
    yield server
    server.stop()


def write_big(tier: ValkeyBackend) -> None:
    block = bytearray(os.urandom(BIG))
    tier.put_blocks([make_offload_key(os.urandom(16), 0)], [block])


def tier_on(server, **options) -> ValkeyBackend:
    return ValkeyBackend("shared", 64, BIG, url=server.url, timeout_ms=1000, breaker_open_s=60,
                         fingerprint="modes/auth", layout="test", **options)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_big_write_without_the_password_warns_that_the_server_requires_one(password_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier")
    tier = tier_on(password_server)
    try:
        write_big(tier)  # (a failed write pauses publishing: the next ones are not sent)
    finally:
        tier.close()
    warnings = warnings_of(caplog)
    assert len(warnings) == 1, warnings
    assert "(AuthenticationError)" in warnings[0]
    assert "the server requires a password and none is given" in warnings[0]
    assert "password_env" in warnings[0] and "password_file" in warnings[0]
    assert "Broken pipe" not in warnings[0] and "(ResponseError)" not in warnings[0]
    assert tier.counters["write_failures"] == 1


def test_a_store_without_the_password_raises_authentication_for_every_call(password_server, make_store):
    store = make_store(password_server.url, block_bytes=BIG, breaker_failures=100)
    key = make_offload_key(b"b" * 16, 0)
    calls = [(store.write_block, (key, memoryview(bytearray(BIG)))), (store.probe, ([key],)),
             (store.read_block, (key, memoryview(bytearray(BIG))))]
    for call, args in calls * 2:
        with pytest.raises(RemoteUnavailable) as info:
            call(*args)
        assert info.value.cause == "AuthenticationError", str(info.value)
        assert "requires a password" in str(info.value)
    assert store.stats()["refused"] == 6


def test_a_wrong_password_is_named_with_the_option_to_fix(password_server, monkeypatch, caplog):
    monkeypatch.setenv("KVT_MODES_PW", "not-" + PASSWORD)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    tier = tier_on(password_server, password_env="KVT_MODES_PW")
    try:
        write_big(tier)
        reason = tier.store.reason
    finally:
        tier.close()
    warning, = warnings_of(caplog)
    assert "authentication failed: the server refused the username and password given (WRONGPASS" in warning
    assert "password_env or password_file" in warning
    assert PASSWORD not in caplog.text + reason


def test_a_cluster_that_requires_a_password_says_so(private_cluster, make_store):
    for node in private_cluster.servers:
        node.client().config_set("masterauth", PASSWORD)
        node.client().config_set("requirepass", PASSWORD)
    store = make_store(private_cluster.url, wait=False)
    assert not store.wait_ready(3.0)
    assert "the server requires a password and none is given" in store.reason and "password_env" in store.reason
    wrong = make_store(private_cluster.url, wait=False, password="not-" + PASSWORD)
    assert not wrong.wait_ready(3.0)
    assert "the server refused the username and password given" in wrong.reason and PASSWORD not in wrong.reason


def test_the_check_says_a_password_is_given_to_a_server_without_one(valkey_server, tmp_path, capsys, monkeypatch):
    """AUTH sent to a server whose default user has no password: before, "wrong username or password"."""
    monkeypatch.setenv("KVT_MODES_PW", PASSWORD)
    code, out, err = env_check(tmp_path, capsys, valkey_server.url, ", password_env: KVT_MODES_PW")
    assert code == 2, out
    assert f"tiers[1].password_env: server {valkey_server.name}: authentication failed: a password is given but " \
           f"the server has none set" in err
    assert PASSWORD not in out + err


def test_the_check_says_the_server_requires_a_password(password_server, tmp_path, capsys):
    code, out, err = env_check(tmp_path, capsys, password_server.url)
    assert code == 2, out
    assert f"tiers[1].password_env: server {password_server.name}: authentication required: the server requires " \
           f"a password and none is given" in err
    assert "password_file" in err and "(AuthenticationError)" in err
