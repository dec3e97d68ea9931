"""`kvtier config check --env` against this machine for real: a valkey tier's server is reached and
authenticated (a real valkey-server: wrong password, dead port, an ACL user without the tier's
keys), and each local tier's capacity is compared with the room the build would find (/dev/shm or
memory for a cpu tier, the disk under a file tier's root_dir). Before, all of these passed."""

from __future__ import annotations

import pytest
from remote.servers import free_port, make_certificates, start_tls_server
from test_config_env import check  # config check FILE FLAGS -> (exit status, stdout, stderr)

PASSWORD = "env-check-right"


def run_check(tmp_path, text: str, capsys) -> tuple[int, str, str]:
    return check(tmp_path, text, capsys, "--env")


def shared_yaml(url: str, extra: str = "") -> str:
    return ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: shared, backend: valkey, capacity: 64 blocks, url: '{url}', timeout_ms: 500{extra}}}\n")


@pytest.fixture
def acl_server(private_server):
    """A server with user `tenant` (password PASSWORD) allowed keys `tenant:*` only."""
    private_server.add_acl_user("tenant", PASSWORD, "tenant")
    return private_server


def test_a_reachable_server_with_the_right_password_passes(acl_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVT_CHECK_PW", PASSWORD)
    code, out, err = run_check(tmp_path, shared_yaml(acl_server.url, ", username: tenant, password_env: "
                                                     "KVT_CHECK_PW, key_prefix: tenant"), capsys)
    assert code == 0, err
    assert f"{acl_server.name} answered PING and EXISTS as tenant" in out and PASSWORD not in out + err


def test_a_wrong_password_is_reported_with_its_cause(acl_server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVT_CHECK_PW", "not-the-password")
    code, out, err = run_check(tmp_path, shared_yaml(acl_server.url, ", username: tenant, password_env: "
                                                     "KVT_CHECK_PW, key_prefix: tenant"), capsys)
    assert code == 2
    assert f"tiers[1].password_env: server {acl_server.name}: authentication failed" in err
    assert "AuthenticationError" in err and "not-the-password" not in out + err


def test_a_server_that_needs_a_password_is_reported_without_one(private_server, tmp_path, capsys):
    private_server.client().config_set("requirepass", PASSWORD)
    code, _, err = run_check(tmp_path, shared_yaml(private_server.url), capsys)
    assert code == 2 and "tiers[1].password_env" in err and "requires a password" in err


def test_an_acl_user_without_the_tiers_keys_is_refused_as_noperm(acl_server, tmp_path, capsys, monkeypatch):
    """The user may PING, but the tier's keys (`kvt:*`, the default prefix) are not its own."""
    monkeypatch.setenv("KVT_CHECK_PW", PASSWORD)
    code, _, err = run_check(tmp_path, shared_yaml(acl_server.url, ", username: tenant, password_env: "
                                                   "KVT_CHECK_PW"), capsys)
    assert code == 2 and "tiers[1].username" in err and "NOPERM" in err and "NoPermissionError" in err


def test_a_dead_port_is_reported_as_connection_refused(tmp_path, capsys):
    port = free_port()
    code, _, err = run_check(tmp_path, shared_yaml(f"redis://127.0.0.1:{port}"), capsys)
    assert code == 2
    assert f"tiers[1].url: server 127.0.0.1:{port}: connection refused" in err


def test_a_cpu_tier_larger_than_shm_and_memory_is_reported(tmp_path, capsys):
    text = "block_bytes: 1MiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 900TiB}\n"
    code, _, err = run_check(tmp_path, text, capsys)
    assert code == 2
    assert "tiers[0].capacity: 900TiB is more than the " in err  # available memory or free space in /dev/shm
    assert "lower the capacity" in err


def test_a_file_tier_larger_than_its_disk_is_reported(tmp_path, capsys):
    root = tmp_path / "tier"  # to be created: the free space of its parent counts
    text = ("block_bytes: 1MiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: nvme, backend: file, capacity: 900TiB, root_dir: '{root}'}}\n")
    code, out, err = run_check(tmp_path, text, capsys)
    assert code == 2
    assert f"tiers[1].capacity: 900TiB does not fit on the filesystem of {root} (" in err and "free)" in err
    assert not root.exists()


def test_a_capacity_that_fits_is_said_to_fit(tmp_path, capsys):
    text = ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n"
            f"  - {{name: nvme, backend: file, capacity: 64 blocks, root_dir: '{tmp_path / 'tier'}'}}\n")
    code, out, err = run_check(tmp_path, text, capsys)
    assert code == 0, err
    assert "tiers[0] cpu: capacity 32KiB fits" in out and "capacity 256KiB fits" in out


def test_a_cluster_is_reached_through_its_seeds(valkey_cluster, tmp_path, capsys):
    dead = f"127.0.0.1:{free_port()}"
    url = valkey_cluster.url + "," + dead
    code, out, err = run_check(tmp_path, shared_yaml(url), capsys)
    assert code == 0, err
    assert "answered PING" in out and f"no answer from server {dead}: connection refused" in out


def test_a_tls_server_with_the_wrong_ca_is_reported_as_tls(tmp_path, capsys):
    server = start_tls_server(tmp_path / "tls")
    try:
        other_ca = make_certificates(tmp_path / "other")[0]
        url = f"rediss://127.0.0.1:{server.port}"
        code, out, err = run_check(tmp_path, shared_yaml(url, f", tls_ca_file: '{server.tls_ca}'"), capsys)
        assert code == 0, err
        code, _, err = run_check(tmp_path, shared_yaml(url, f", tls_ca_file: '{other_ca}'"), capsys)
        assert code == 2 and f"tiers[1].tls_ca_file: server 127.0.0.1:{server.port}: TLS handshake failed" in err
    finally:
        server.stop()


def test_a_server_that_does_not_answer_in_time_is_reported_as_a_timeout(private_server, tmp_path, capsys):
    private_server.pause(3000)  # CLIENT PAUSE: the PING waits past timeout_ms (500 ms here)
    code, _, err = run_check(tmp_path, shared_yaml(private_server.url), capsys)
    assert code == 2
    assert f"tiers[1].url: server {private_server.name}: timeout: no answer within timeout_ms (500 ms)" in err
