"""`kvtier inspect --metrics URL`: a running engine's tiers, read from its Prometheus endpoint:
per tier the blocks resident, retained by sessions' hints and of ended sessions, and the
retention's counters (issue 40: "`kvtier inspect` shows them per tier"); a URL that cannot be
read or serves no kvtier metrics exits 2, naming `--metrics`."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest
from test_standalone import keys, make_kv

from kvtier import load_config_text
from kvtier.cli import inspect_live
from kvtier.cli.inspect_live import live_report
from kvtier.cli.main import main
from kvtier.standalone import KVTier

TWO_TIERS = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}\n"
                             "  - {name: mem, backend: memory, capacity: 32 blocks}\n")

# What vLLM's /metrics serves with kvtier's connector (two engines: data parallel), abridged.
VLLM_PAGE = """\
# HELP vllm:kvtier_retained_blocks kvtier: Blocks of this tier kept by sessions' retention hints now.
# TYPE vllm:kvtier_retained_blocks gauge
vllm:kvtier_retained_blocks{engine="0",model_name="m",tier="cpu"} 12.0
vllm:kvtier_retained_blocks{engine="1",model_name="m",tier="cpu"} 0.0
vllm:kvtier_resident_blocks{engine="0",model_name="m",tier="cpu"} 40.0
vllm:kvtier_capacity_blocks{engine="0",model_name="m",tier="cpu"} 64.0
vllm:kvtier_ended_blocks{engine="0",model_name="m",tier="cpu"} 3.0
vllm:kvtier_hits_total{engine="0",model_name="m",tier="cpu"} 7.0
# TYPE vllm:kvtier_retention_expired counter
vllm:kvtier_retention_expired_total{engine="0",model_name="m"} 2.0
vllm:kvtier_retention_expired_created{engine="0",model_name="m"} 1.7648e+09
vllm:kvtier_retention_sessions{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


@pytest.fixture
def serve() -> Iterator:
    """`serve(body)`: the URL of a local HTTP server answering every GET with `body`."""
    servers = []

    def start(body: bytes) -> str:
        class Page(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}/metrics"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_standalone_engines_tiers_show_what_its_sessions_keep(tmp_path, capsys):
    tier = KVTier.open(TWO_TIERS, make_kv(), metrics_port=0)
    try:
        assert tier.store(keys(3), [1, 2, 3], hints={"session": "chat", "retain_s": 60})
        assert tier.store(keys(2, 10), [4, 5], hints={"session": "one-shot", "session_ended": True})
        out = tmp_path / "live.json"
        assert main(["inspect", "--metrics", tier.metrics_url, "--json", str(out)]) == 0
    finally:
        tier.close()
    printed = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in printed[1:4]}
    assert rows["tier"] == ["resident", "capacity", "retained", "ended"]
    assert rows["cpu"] == ["5", "16", "3", "2"] and rows["mem"] == ["0", "32", "0", "0"]
    assert any(line.startswith("retention (all): ") and "sessions 1" in line and "hints 2" in line
               for line in printed)
    report = json.loads(out.read_text())
    assert report["tiers"]["cpu"] == {"resident_blocks": 5, "capacity_blocks": 16, "retained_blocks": 3,
                                      "ended_blocks": 2}
    assert report["retention"]["all"]["retained_blocks"] == 3


def test_vllms_page_is_read_per_engine_counters_without_their_suffixes():
    report = live_report(VLLM_PAGE)
    assert report["tiers"] == {"engine 0/cpu": {"retained_blocks": 12, "resident_blocks": 40, "capacity_blocks": 64,
                                                "ended_blocks": 3},
                               "engine 1/cpu": {"retained_blocks": 0}}
    assert report["retention"] == {"engine 0": {"expired": 2, "sessions": 1}}
    one_engine = "\n".join(line for line in VLLM_PAGE.splitlines() if 'engine="1"' not in line)
    assert set(live_report(one_engine)["tiers"]) == {"cpu"} and set(live_report(one_engine)["retention"]) == {"all"}


def test_an_engine_without_hints_says_so(serve, capsys):
    url = serve(b'kvtier_tier_resident_blocks{tier="cpu"} 4.0\nkvtier_tier_capacity_blocks{tier="cpu"} 8.0\n')
    assert main(["inspect", "--metrics", url]) == 0
    out = capsys.readouterr().out
    assert "retention: no hint given yet" in out and out.splitlines()[2].split() == ["cpu", "4", "8", "-", "-"]


@pytest.mark.parametrize("argv, says", [
    ([], "give the ROOT_DIR of a file tier, or --metrics URL"),
    (["/tmp", "--metrics", "http://127.0.0.1:1/metrics"], "not both"),
    # (before: "not both", though no ROOT_DIR was given)
    (["--metrics", "http://127.0.0.1:1/metrics", "--verify"], "--verify reads a file tier's blocks: give it with"),
    (["--metrics", "ftp://host/metrics"], "--metrics: 'ftp://host/metrics' is no http(s) URL"),
    (["--metrics", "http://127.0.0.1:1/metrics"], "--metrics: cannot read http://127.0.0.1:1/metrics"),
])
def test_a_wrong_invocation_or_unreachable_url_exits_2_and_says_why(argv, says, capsys):
    assert main(["inspect", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_tier_name_with_control_characters_is_printed_escaped(serve, capsys):
    url = serve(b'kvtier_tier_resident_blocks{tier="evil\x1b[2J"} 1.0\n')
    assert main(["inspect", "--metrics", url]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[2J" in out


def test_a_page_without_kvtier_metrics_exits_2(serve, capsys):
    url = serve(b"# a server that is not an engine\nprocess_cpu_seconds_total 1.5\n")
    assert main(["inspect", "--metrics", url]) == 2
    assert "serves no kvtier metrics" in capsys.readouterr().err


def test_a_page_larger_than_any_metrics_page_is_refused(serve, capsys, monkeypatch):
    monkeypatch.setattr(inspect_live, "MAX_BYTES", 64)
    url = serve(b'kvtier_tier_resident_blocks{tier="cpu"} 1.0\n' * 4)
    assert main(["inspect", "--metrics", url]) == 2
    assert "served more than" in capsys.readouterr().err
