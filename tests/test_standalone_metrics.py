"""`KVTier.open(..., metrics_port=)`: Prometheus text of `stats()` on that port until `close()`."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_standalone import keys, make_kv

from kvtier import load_config_text
from kvtier.core.errors import ArgumentError, ArgumentTypeError
from kvtier.standalone import KVTier

pytest.importorskip("torch")
pytest.importorskip("prometheus_client")

CPU = load_config_text("tiers:\n  - {name: cpu, backend: cpu, capacity: 16 blocks, pin: false}\n")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def value(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in:\n{text}"
    return float(match.group(1))


def test_metrics_endpoint_serves_the_stats_and_stops_on_close():
    tier = KVTier.open(CPU, make_kv(), metrics_port=0)
    try:
        url = tier.metrics_url
        assert url is not None and re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*/metrics", url)
        assert tier.store(keys(3), [1, 2, 3])
        text = scrape(url)
        assert value(text, "kvtier_tier_resident_blocks", '{tier="cpu"}') == 3
        assert value(text, "kvtier_tier_capacity_blocks", '{tier="cpu"}') == 16
        assert value(text, "kvtier_engine_stores") == 3  # blocks
        assert tier.load(keys(3), [4, 5, 6]) == 3
        assert value(scrape(url), "kvtier_engine_loads") == 3  # read at each scrape
    finally:
        tier.close()
    with pytest.raises(urllib.error.URLError):
        scrape(url)


def test_the_retention_counters_are_served_once_a_hint_was_given():
    tier = KVTier.open(CPU, make_kv(), metrics_port=0)
    try:
        url = tier.metrics_url
        assert tier.store(keys(3), [1, 2, 3])
        assert "kvtier_retention_" not in scrape(url)  # (no hint yet: nothing to report)
        assert tier.store(keys(3), [1, 2, 3], hints={"session": "chat", "retain_s": 60})
        text = scrape(url)
        assert value(text, "kvtier_retention_sessions") == 1
        assert value(text, "kvtier_retention_retained_blocks") == 3
        assert value(text, "kvtier_tier_retained_blocks", '{tier="cpu"}') == 3
        assert "sessions retaining blocks now" in text  # (the HELP says what it counts)
        assert tier.load(keys(3), [4, 5, 6], hints={"session": "chat", "session_ended": True}) == 3
        text = scrape(url)
        assert value(text, "kvtier_retention_ended") == 1 and value(text, "kvtier_retention_hints") == 2
        assert value(text, "kvtier_retention_sessions") == 0
    finally:
        tier.close()


def port_of(tier: KVTier) -> int:
    """The port of a KVTier's metrics endpoint, read from its public `metrics_url`."""
    match = re.fullmatch(r"http://.+:(\d+)/metrics", tier.metrics_url or "")
    assert match, tier.metrics_url
    return int(match.group(1))


def test_a_bad_metrics_port_is_refused_before_anything_is_built():
    with pytest.raises(ArgumentError, match=r"metrics_port: 70000 is not a TCP port"):
        KVTier.open(CPU, make_kv(), metrics_port=70000)
    with pytest.raises(ArgumentTypeError, match=r"metrics_port: str '9400'"):
        KVTier.open(CPU, make_kv(), metrics_port="9400")


def test_a_port_in_use_is_an_argument_error_and_nothing_stays_open():
    first = KVTier.open(CPU, make_kv(), metrics_port=0)
    try:
        port = port_of(first)
        with pytest.raises(ArgumentError, match=rf"metrics_port: cannot serve on 127\.0\.0\.1:{port}"):
            KVTier.open(CPU, make_kv(), metrics_port=port)
    finally:
        first.close()


def test_a_bad_metrics_addr_is_named_and_none_never_means_every_interface():
    """Before: None listened on every interface (url 'http://None:N/metrics'), 5 raised a bare
    TypeError and a host name that resolves nowhere was blamed on metrics_port."""
    with pytest.raises(ArgumentTypeError, match=r"metrics_addr: NoneType None; an address string"):
        KVTier.open(CPU, make_kv(), metrics_port=0, metrics_addr=None)
    with pytest.raises(ArgumentTypeError, match=r"metrics_addr: int 5"):
        KVTier.open(CPU, make_kv(), metrics_port=0, metrics_addr=5)
    with pytest.raises(ArgumentError, match=r"metrics_addr: 'no-such-host\.invalid' is no address of this host"):
        KVTier.open(CPU, make_kv(), metrics_port=0, metrics_addr="no-such-host.invalid")


def test_an_ipv6_metrics_addr_gives_a_bracketed_url():
    try:
        tier = KVTier.open(CPU, make_kv(), metrics_port=0, metrics_addr="::1")
    except ArgumentError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    try:
        assert re.fullmatch(r"http://\[::1\]:[1-9]\d*/metrics", tier.metrics_url or "")
        assert value(scrape(tier.metrics_url), "kvtier_tier_capacity_blocks", '{tier="cpu"}') == 16
    finally:
        tier.close()


def test_close_frees_the_port_and_two_tiers_serve_apart():
    first, second = KVTier.open(CPU, make_kv(), metrics_port=0), KVTier.open(CPU, make_kv(), metrics_port=0)
    port = port_of(first)
    assert port != port_of(second)
    first.close()
    assert value(scrape(second.metrics_url), "kvtier_tier_capacity_blocks", '{tier="cpu"}') == 16
    second.close()
    again = KVTier.open(CPU, make_kv(), metrics_port=port)  # the port was released by close()
    again.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_ends_the_connections_slow_clients_still_hold():
    """Issue 36.8: 20 clients connect and send half a request line; after `close()` no thread or
    descriptor of the endpoint is left (on 7e6c7c1: one thread and one descriptor per client,
    for as long as the client held on) and each client sees its connection end."""
    threads, fds = threading.active_count(), _open_fds()
    tier = KVTier.open(CPU, make_kv(), metrics_port=0)
    clients = []
    try:
        for _ in range(20):
            client = socket.create_connection(("127.0.0.1", port_of(tier)), timeout=10)
            client.sendall(b"GET /met")
            clients.append(client)
        deadline = time.monotonic() + 10
        while threading.active_count() < threads + 21 and time.monotonic() < deadline:
            time.sleep(0.01)  # every connection is being served
    finally:
        started = time.monotonic()
        tier.close()
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert threading.active_count() == threads, f"{threading.active_count() - threads} threads left"
        assert _open_fds() == fds + len(clients), f"{_open_fds() - fds - len(clients)} descriptors left"
        for client in clients:
            assert client.recv(1) == b""  # the server ended it
    finally:
        for client in clients:
            client.close()


def test_an_address_of_no_interface_here_is_blamed_on_metrics_addr():
    """Issue 36.12: 10.9.9.9 (no interface of this host) was reported as a port problem."""
    with pytest.raises(ArgumentError, match=r"^metrics_addr: '10\.9\.9\.9' is not an address of any interface of "
                                            r"this host \(Cannot assign requested address\)"):
        KVTier.open(CPU, make_kv(), metrics_port=0, metrics_addr="10.9.9.9")
