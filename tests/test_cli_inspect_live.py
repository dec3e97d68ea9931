"""`kvtier inspect --metrics URL`: a running engine's tiers, read from its Prometheus endpoint:
per tier the blocks resident, retained by sessions' hints and of ended sessions, and the
retention's counters (issue 40: "`kvtier inspect` shows them per tier"); a URL that cannot be
read or serves no kvtier metrics exits 2, naming `--metrics`."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from test_standalone import keys, make_kv

from kvtier import load_config_text
from kvtier.cli import inspect_live
from kvtier.cli.inspect_live import live_report
from kvtier.cli.main import main
from kvtier.core.errors import KVTierError
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


@pytest.fixture
def raw() -> Iterator:
    """`raw(answer)`: the URL of a local TCP server that reads a request, then calls
    `answer(send)` (`send(bytes)`; an OSError ends the answer) and closes the connection."""
    listeners = []

    def start(answer) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4096)
                    try:
                        answer(conn.sendall)
                    except OSError:
                        pass

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"

    yield start
    for listener in listeners:
        listener.close()


def _trickle(prefix: bytes):
    """An answer sending `prefix`, then one byte every 0.1 s for 20 s (no single read times out)."""
    def answer(send) -> None:
        send(prefix)
        for _ in range(200):
            send(b"#")
            time.sleep(0.1)
    return answer


@pytest.mark.parametrize("prefix", [b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n", b"HTTP/1.1 200 OK\r\nX-A: "],
                         ids=["body", "headers"])
def test_a_page_sent_byte_by_byte_is_given_up_at_the_deadline(raw, prefix):
    """Before: urllib's timeout bounds each read, not the request, and the command never returned."""
    url = raw(_trickle(prefix))
    began = time.monotonic()
    with pytest.raises(KVTierError, match=r"did not send its whole page within 1 s"):
        inspect_live.read_metrics(url, timeout=1.0)
    assert time.monotonic() - began < 5


@pytest.mark.parametrize(("answer", "says"), [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "did not answer in HTTP: BadStatusLine"),
    (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", "did not answer in HTTP"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "did not answer in HTTP: IncompleteRead"),
    (b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nkvtier_tier_resident_blocks{tier="cpu"} 3\n',
     "closed the connection 958 bytes short of its Content-Length (42 received)"),
], ids=["not-http", "headers", "chunk", "short"])
def test_an_answer_that_is_not_a_whole_http_page_exits_2_and_says_why(raw, capsys, answer, says):
    """Before: a traceback and exit 1 for the first three; the page cut short was shown (exit 0)."""
    url = raw(lambda send: send(answer))
    assert main(["inspect", "--metrics", url]) == 2
    assert says in capsys.readouterr().err


def test_samples_that_are_not_finite_are_left_out_and_the_json_is_strict(serve, tmp_path, capsys):
    """Before: `NaN` and `Infinity` were printed and written, which no strict JSON parser reads."""
    url = serve(b'kvtier_tier_resident_blocks{tier="cpu"} NaN\nkvtier_tier_capacity_blocks{tier="cpu"} +Inf\n'
                b'kvtier_tier_retained_blocks{tier="cpu"} 2\n')
    path = tmp_path / "live.json"
    assert main(["inspect", "--metrics", url, "--json", str(path)]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"non-JSON constant {constant}")

    report = json.loads(path.read_text(), parse_constant=refuse)
    assert report["tiers"] == {"cpu": {"retained_blocks": 2.0}}
    assert "nan" not in capsys.readouterr().out
