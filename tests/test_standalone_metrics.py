"""`KVTier.open(..., metrics_port=)`: Prometheus text of `stats()` on that port until `close()`."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from test_standalone import keys, make_kv

from kvtier import load_config_text
from kvtier.errors import ArgumentError, ArgumentTypeError
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
        assert value(text, "kvtier_engine_stores") == 1
        assert tier.load(keys(3), [4, 5, 6]) == 3
        assert value(scrape(url), "kvtier_engine_loads") == 1  # read at each scrape
    finally:
        tier.close()
    with pytest.raises(urllib.error.URLError):
        scrape(url)


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
