"""ClientOptions' URL forms and checks, key prefixes and the key format (no server needed)."""

from __future__ import annotations

import pytest

from kvtier.core.errors import ArgumentError
from kvtier.core.keys import make_offload_key
from kvtier.tiers.remote.keys import KeyScheme, identity_digest, validate_key_prefix
from kvtier.tiers.remote.options import ClientOptions
from kvtier.tiers.remote.url import Endpoint, parse_url


def test_url_forms():
    assert parse_url("redis://10.0.0.1") == parse_url("redis://10.0.0.1:6379/0")
    single = parse_url("rediss://cache.example:7000/3")
    assert (single.cluster, single.tls, single.db) == (False, True, 3)
    assert single.endpoints == (Endpoint("cache.example", 7000),)
    assert parse_url("redis://[::1]:6380").endpoints[0].name == "[::1]:6380"
    assert parse_url("unix:///run/valkey.sock").endpoints == (Endpoint(unix_path="/run/valkey.sock"),)
    cluster = parse_url("clusters://a:7000,b:7001,[::1]:7002")
    assert cluster.cluster and cluster.tls
    assert [e.name for e in cluster.endpoints] == ["a:7000", "b:7001", "[::1]:7002"]


@pytest.mark.parametrize("url, words", [
    ("", "non-empty"),
    ("http://h:1", "must start with one of"),
    ("h:6379", "no scheme"),
    ("redis://h:0", "port '0'"),
    ("redis://h:99999", "1 to 65535"),
    ("redis://h:", "no port"),
    ("redis://:6379", "no host"),
    ("redis://h/x", "database number"),
    ("redis://a:1,b:2", "cluster form"),
    ("cluster://a:1,,b:2", "seed 1"),
    ("cluster://a:1/0", "no path"),
    ("redis://h?db=1", "query"),
    ("unix://relative", "absolute socket path"),
    ("redis://::1:6379", "brackets"),
])
def test_bad_urls_name_the_field(url, words):
    with pytest.raises(ValueError, match="^url") as info:
        ClientOptions(url)
    assert words in str(info.value)


def test_credentials_in_the_url_are_refused_without_echoing_them():
    with pytest.raises(ValueError, match="credentials are not accepted") as info:
        ClientOptions("redis://user:s3cret-pw@h:6379")
    assert "s3cret-pw" not in str(info.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"timeout_s": 0}, "timeout_s"), ({"connect_timeout_s": -1}, "connect_timeout_s"),
    ({"breaker_failures": 0}, "breaker_failures"), ({"breaker_open_s": True}, "breaker_open_s"),
    ({"tls_ca_file": "/ca.pem"}, "tls_ca_file"), ({"username": "u"}, "password"),
    ({"password": ""}, "password"),
])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        ClientOptions("redis://h", **kwargs)


def test_client_certificate_needs_cert_and_key():
    with pytest.raises(ValueError, match="tls_cert_file, tls_key_file"):
        ClientOptions("rediss://h", tls_cert_file="/c.pem")
    ClientOptions("rediss://h", tls_cert_file="/c.pem", tls_key_file="/k.pem", tls_ca_file="/ca.pem")


def test_password_never_shown():
    options = ClientOptions("redis://h", username="tenant", password="s3cret-pw")
    assert "s3cret-pw" not in repr(options) and "s3cret-pw" not in str(options.redacted())
    assert options.redacted()["password_set"] is True and options.redacted()["username"] == "tenant"


@pytest.mark.parametrize("prefix, words", [
    ("", "non-empty"), ("a b", "' '"), ("a\nb", "'\\n'"), ("t{x}", "'{'"), ("t*", "'*'"),
    ("kvt:", "ends with ':'"), ("x" * 129, "at most 128"), ("é", "'é'"),
])
def test_bad_key_prefixes(prefix, words):
    with pytest.raises(ValueError, match="^key_prefix") as info:
        validate_key_prefix(prefix)
    assert words in str(info.value)


def test_key_format():
    scheme = KeyScheme("kvt:tenantA", "org/model:rev:1", "layout-a", tp=2)
    key = make_offload_key(bytes.fromhex("00ff10"), 258)
    tag = identity_digest("org/model:rev:1", "layout-a")[:8].hex()
    assert scheme.part_keys(key) == [f"kvt:tenantA:{tag}:0of2:00ff10:258".encode(),
                                     f"kvt:tenantA:{tag}:1of2:00ff10:258".encode()]
    assert len(scheme.tag) == 16 and ":" not in scheme.tag


def test_identity_separates_fingerprint_from_layout():
    """A ':' or a NUL cannot make two different (fingerprint, layout) pairs one identity."""
    assert identity_digest("m", "a:b") != identity_digest("m:a", "b")
    assert KeyScheme("p", "m", "L1").tag != KeyScheme("p", "m", "L2").tag


def test_bad_offload_keys():
    scheme = KeyScheme("p", "m", "L")
    with pytest.raises(ArgumentError, match="^key"):
        scheme.part_keys(b"\0\0\0\1")
    with pytest.raises(TypeError, match="^key"):
        scheme.part_keys("abc")  # type: ignore[arg-type]
