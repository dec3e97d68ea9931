"""`shared:` in the YAML, the mapping an engine sends the owner, and `kvtier serve`'s arguments."""

from __future__ import annotations

import pytest

from kvtier.cli.main import main
from kvtier.config import load_config_text, parse_config
from kvtier.config.shared import DEFAULT_TIMEOUT_MS, SharedHost, config_mapping, default_socket_path
from kvtier.core.errors import ConfigError

TIERS = "tiers:\n  - {name: cpu, backend: cpu, capacity: 8 blocks}\n"


def test_shared_host_takes_the_default_socket_and_deadline():
    assert load_config_text("shared: host\n" + TIERS).shared == SharedHost(default_socket_path(), DEFAULT_TIMEOUT_MS)
    assert load_config_text(TIERS).shared is None


def test_shared_mapping_names_the_socket_and_deadline():
    config = load_config_text("shared: {scope: host, socket: /run/k/h.sock, timeout_ms: 7}\n" + TIERS)
    assert config.shared == SharedHost("/run/k/h.sock", 7)


@pytest.mark.parametrize("value, message", [
    ("cluster", "expected 'host' or a mapping"),
    ("{scope: rack}", "scope: 'rack' is not one of host"),
    ("{socket: relative.sock}", "relative"),
    ("{socket: /" + "x" * 120 + "}", "at most 107 bytes"),
    ("{timeout_ms: 0}", "timeout_ms: expected an integer from 1 to 60000"),
    ("{timeout_ms: true}", "timeout_ms"),
    ("{timeout: 5}", "unknown key\\(s\\) timeout"),
    ("{socket: ''}", "socket: expected an absolute path"),  # (before: the default socket, silently)
    # every problem at once (before: one per run)
    ("{scope: hosts, socket: rel.sock, timeout_ms: 0, extra: 1}",
     "unknown key.*extra.*scope: 'hosts'.*socket:.*relative.*timeout_ms: expected"),
])
def test_a_bad_shared_setting_names_what_is_wrong(value, message):
    with pytest.raises(ConfigError, match="shared") as info:
        load_config_text(f"shared: {value}\n" + TIERS)
    assert any(__import__("re").search(message, text) for _, text in info.value.problems), info.value.problems


def test_the_mapping_sent_to_the_owner_parses_back_to_the_same_tiers(tmp_path):
    config = load_config_text(f"""
store_threshold: 2
tiers:
  - {{name: cpu, backend: cpu, capacity: 3MiB, policy: lru, cascade: on_store, reserve: 0.2, pin: false}}
  - {{name: nvme, backend: file, root_dir: {tmp_path}, capacity: 40 blocks, sync_interval: 0}}
""")
    again = parse_config(config_mapping(config))
    assert again.tiers == config.tiers and again.store_threshold == 2


@pytest.mark.parametrize("argv, message", [
    (["serve", "--socket", "rel.sock"], "--socket: expected an absolute path"),
    (["serve", "--socket", "/tmp/s.sock", "--max-clients", "0"], "--max-clients: expected at least 1"),
    (["serve", "--socket", "/tmp/s.sock", "--max-namespaces", "0"], "--max-namespaces: expected at least 1"),
    (["serve", "--socket", "/tmp/s.sock", "--idle-namespace-s", "-1"],
     "--idle-namespace-s: expected a finite number of seconds >= 0, got -1"),
    (["serve", "--socket", "/tmp/s.sock", "--flush-timeout", "nan"],
     "--flush-timeout: expected a finite number of seconds >= 0, got nan"),
])
def test_serve_refuses_bad_arguments_with_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_config_check_says_whose_tiers_they_are(tmp_path, capsys):
    path = tmp_path / "shared.yaml"
    path.write_text("shared: {socket: /run/k/h.sock, timeout_ms: 20}\n" + TIERS)
    assert main(["config", "check", str(path)]) == 0
    assert "the owner's at /run/k/h.sock (kvtier serve), each call bounded by timeout_ms=20" in capsys.readouterr().out
