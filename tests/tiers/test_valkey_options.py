"""A `valkey` tier's options: validation with the field's path, the password kept out of YAML,
`kvtier config check`, logs and reprs, and where a shared tier may stand in a hierarchy."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kvtier import build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.core.errors import ConfigError
from kvtier.testing.fake_remote import FakeServer
from kvtier.tiers.remote.backend import ValkeyBackend

SECRET = "s3cr3t-Pa55word-do-not-print"


def yaml(remote: str = "", first: str = "{name: cpu, backend: memory, capacity: 8 blocks}", middle: str = "") -> str:
    url = "" if "url:" in remote else ", url: 'redis://127.0.0.1:6379'"  # (a key given twice is refused)
    tiers = [first] + ([middle] if middle else []) + [
        f"{{name: shared, backend: valkey, capacity: 64 blocks{url}{remote}}}"]
    return "block_bytes: 4KiB\ntiers:\n" + "".join(f"  - {t}\n" for t in tiers)


def problems(text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config_text(text)
    return dict(info.value.problems)


@pytest.fixture
def server(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(ValkeyBackend, "store_factory", server.store)
    return server


def test_a_valkey_tier_loads_with_its_defaults():
    tier = load_config_text(yaml()).tiers[1]
    assert tier.backend == "valkey"
    assert tier.options["key_prefix"] == "kvt" and tier.options["timeout_ms"] == 250
    assert tier.options["password_env"] is None and tier.options["tls_verify"] is True


@pytest.mark.parametrize("extra, field, fragment", [
    (", url: 'redis://user:pw@host:6379'", "tiers[1].url", "credentials are not accepted in the URL"),
    (", url: 'http://host:6379'", "tiers[1].url", "must start with one of"),
    (", url: 'redis://h1:1,h2:2'", "tiers[1].url", "cluster://"),
    (", key_prefix: 'a b'", "tiers[1].key_prefix", "without spaces"),
    (", key_prefix: '{t}'", "tiers[1].key_prefix", "hash tags"),
    (", username: tenant-a", "tiers[1].username", "needs a password"),
    (", timeout_ms: 0", "tiers[1].timeout_ms", "from 1 to 60000"),
    (", max_inflight_mib: -1", "tiers[1].max_inflight_mib", "above 0"),
    (", breaker_failures: 0", "tiers[1].breaker_failures", "consecutive failures"),
    (", password_env: A, password_file: /x", "tiers[1].password_file", "not both"),
    (", tls_ca_file: /ca.pem", "tiers[1].tls_ca_file", "rediss://"),
    (", url: 'cluster://h:1,h:2', tls_ca_file: /ca.pem", "tiers[1].tls_ca_file", "clusters://"),
    (", url: 'rediss://h:1', tls_cert_file: /c.pem", "tiers[1].tls_key_file", "both tls_cert_file and tls_key_file"),
    (", password: hunter2", "tiers[1].password", "unknown key"),
    (", url: 'redis://h:6379/99999999999999999999'", "tiers[1].url", "above the largest a server accepts"),
])
def test_bad_options_name_their_field(extra, field, fragment):
    found = problems(yaml(extra))
    assert field in found and fragment in found[field], found


def test_a_password_given_where_a_variable_name_goes_is_not_echoed():
    found = problems(yaml(f", password_env: '{SECRET}'"))
    assert "tiers[1].password_env" in found and SECRET not in str(found)


@pytest.mark.parametrize("first, middle, field, fragment", [
    ("{name: shared0, backend: valkey, capacity: 8 blocks, url: 'redis://h:1'}", "", "tiers[0].backend",
     "host-memory first tier"),
    ("{name: cpu, backend: memory, capacity: 8 blocks}",
     "{name: shared0, backend: valkey, capacity: 8 blocks, url: 'redis://h:1'}", "tiers[2].backend",
     "second shared tier"),
])
def test_misplaced_shared_tiers_are_config_errors(first, middle, field, fragment):
    found = problems(yaml(first=first, middle=middle))
    assert field in found and fragment in found[field], found


def test_a_shared_tier_before_a_local_one_is_refused():
    text = ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            "  - {name: shared, backend: valkey, capacity: 8 blocks, url: 'redis://h:1'}\n"
            "  - {name: warm, backend: memory, capacity: 8 blocks}\n")
    found = problems(text)
    assert "must come after every local tier" in found["tiers[1].backend"], found


def test_a_file_first_tier_with_a_shared_tier_is_refused(tmp_path):
    first = f"{{name: disk, backend: file, capacity: 8 blocks, root_dir: '{tmp_path}', fingerprint: m}}"
    found = problems(yaml(first=first))
    assert "host-memory tier" in found["tiers[0].backend"], found


def test_no_cascade_handler_is_needed_into_the_shared_tier(tmp_path):
    """cpu -> file -> valkey: the file tier does not demote into the shared tier (no FILE->REMOTE hop)."""
    middle = f"{{name: disk, backend: file, capacity: 8 blocks, root_dir: '{tmp_path}', fingerprint: m}}"
    config = load_config_text(yaml(middle=middle))
    assert [t.backend for t in config.tiers] == ["memory", "file", "valkey"]


def test_config_check_shows_the_tier_and_never_the_password(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVT_TEST_PASSWORD", SECRET)
    path = tmp_path / "shared.yaml"
    path.write_text(yaml(", password_env: KVT_TEST_PASSWORD, username: tenant-a, key_prefix: tenantA"))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "backend=valkey" in out and "password_env=KVT_TEST_PASSWORD" in out and "key_prefix=tenantA" in out
    assert "shared: publishes cpu's stores" in out and "cascade on_evict to shared" not in out
    assert SECRET not in out


def test_config_check_needs_no_client_library(tmp_path):
    """No Redis/Valkey client library is imported by a config check (kvtier.tiers.remote.store is not)."""
    path = tmp_path / "shared.yaml"
    path.write_text(yaml(", password_env: KVT_TEST_PASSWORD"))
    code = ("import sys\n"
            "for name in ('redis', 'hiredis', 'valkey', 'glide'): sys.modules[name] = None\n"
            "from kvtier.cli.main import main\n"
            f"sys.exit(main(['config', 'check', {str(path)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "backend=valkey" in result.stdout


def test_the_password_reaches_the_store_and_nowhere_else(server, monkeypatch, caplog):
    monkeypatch.setenv("KVT_TEST_PASSWORD", SECRET)
    caplog.set_level(logging.DEBUG, logger="kvtier")
    config = load_config_text(yaml(", password_env: KVT_TEST_PASSWORD, username: tenant-a"))
    with build_hierarchy(config, model="m") as hierarchy:
        backend = hierarchy.backends["shared"]
        assert server.stores[-1].client["password"] == SECRET and server.stores[-1].client["username"] == "tenant-a"
        shown = [repr(backend), str(backend), repr(config), str(hierarchy.manager.get_stats()), caplog.text,
                 repr(vars(backend))]
        assert not [s for s in shown if SECRET in s]
        assert "password=set" in repr(backend)


def test_an_unset_password_variable_is_a_config_error(server, monkeypatch):
    monkeypatch.delenv("KVT_TEST_PASSWORD", raising=False)
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(yaml(", password_env: KVT_TEST_PASSWORD")), model="m")
    assert "tiers[1].password_env" in str(info.value) and "not set" in str(info.value)


def test_a_password_file_must_be_private(server, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    os.chmod(secret, 0o644)
    text = yaml(f", password_file: '{secret}'")
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(text), model="m")
    assert "tiers[1].password_file" in str(info.value) and "chmod 600" in str(info.value)
    assert SECRET not in str(info.value)
    os.chmod(secret, 0o600)
    with build_hierarchy(load_config_text(text), model="m"):
        assert server.stores[-1].client["password"] == SECRET


def test_direct_construction_checks_the_same_options(server):
    with pytest.raises(ConfigError) as info:
        ValkeyBackend("r", 4, 4096, url="redis://u:p@h:1", fingerprint="m")
    assert "url" in dict(info.value.problems)
    with pytest.raises(ConfigError) as info:
        ValkeyBackend("r", 4, 4096, url="redis://h:1")
    assert "fingerprint" in dict(info.value.problems)


def test_the_readme_valkey_example_is_a_valid_tier():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = re.search(r"\*\*A shared tier on Valkey/Redis\*\*.*?```yaml\n(.*?)```", readme, re.S).group(1)
    text = "block_bytes: 1MiB\ntiers:\n  - {name: cpu, backend: cpu, capacity: 1GiB}\n" + snippet
    tier = load_config_text(text, "README.md").tiers[1]
    assert tier.backend == "valkey" and tier.options["password_env"] == "KVT_VALKEY_PASSWORD"
    assert tier.options["key_prefix"] == "kvt:tenantA" and tier.capacity.blocks == 100000


def test_docs_shared_tier_lists_every_option():
    """docs/shared-tier.md's option table names exactly the options the backend accepts."""
    import re
    from pathlib import Path

    from kvtier.tiers.remote.options import OPTIONS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "shared-tier.md").read_text()
    table = doc[doc.index("| option | meaning |"):]
    table = table[:table.index("\n\n")]
    names = [row.split("|")[1].split("(")[0] for row in table.splitlines()[2:]]  # before "(default)"
    documented = {name for cell in names for name in re.findall(r"`(\w+)`", cell)}
    assert documented == set(OPTIONS)


def test_docs_shared_tier_config_example_is_a_valid_hierarchy():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "shared-tier.md").read_text()
    text = re.search(r"## Configuration\n\n```yaml\n(.*?)```", doc, re.S).group(1)
    config = load_config_text(text, "docs/shared-tier.md")
    assert [t.backend for t in config.tiers] == ["cpu", "valkey"]
    assert config.tiers[1].options["url"].startswith("cluster://") and config.tiers[1].options["tp"] == 1


@pytest.mark.parametrize("extra, field, secret, fragment", [
    (f", url: 'redis://127.0.0.1:6390/0?password={SECRET}'", "tiers[1].url", SECRET, "?<redacted>"),
    (f", url: 'redis://127.0.0.1:6390/{SECRET}'", "tiers[1].url", SECRET, "database number"),
    (f", password_file: '{SECRET}'", "tiers[1].password_file", SECRET, "path of a file"),
])
def test_errors_name_the_field_without_a_value_that_may_be_a_secret(extra, field, secret, fragment, tmp_path,
                                                                    capsys):
    found = problems(yaml(extra))
    assert field in found and fragment in found[field] and secret not in str(found), found
    path = tmp_path / "c.yaml"
    path.write_text(yaml(extra))
    assert main(["config", "check", str(path)]) == 2
    out = capsys.readouterr()
    assert field in out.err and secret not in out.err + out.out


def test_redact_url_hides_userinfo_query_and_fragment():
    from kvtier.tiers.remote.url import redact_url

    assert redact_url(f"redis://u:{SECRET}@h:1/0?password={SECRET}#{SECRET}") == "redis://<redacted>@h:1/0?<redacted>"
    assert redact_url("cluster://h:1,h:2") == "cluster://h:1,h:2"


def test_a_symlinked_password_file_is_named_a_symlink(server, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    os.chmod(secret, 0o600)
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(ConfigError) as info:
        build_hierarchy(load_config_text(yaml(f", password_file: '{link}'")), model="m")
    assert "tiers[1].password_file" in str(info.value) and "is a symlink" in str(info.value)


def test_the_unknown_key_error_lists_every_valid_key_and_limits_read_as_integers():
    from kvtier.tiers.remote.options import OPTIONS

    found = problems(yaml(", tiemout_ms: 250, max_inflight_mib: 0"))
    unknown = found["tiers[1].tiemout_ms"]
    assert "timeout_ms" in unknown and "…" not in unknown
    assert all(name in unknown.split("valid keys: ")[1].split(", ") for name in OPTIONS)
    assert "at most 1048576," in found["tiers[1].max_inflight_mib"]
