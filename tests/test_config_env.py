"""`kvtier config check --env`: what each tier's backend reads when it is built, checked on this
machine without changing anything (the valkey tier's password and TLS files, the file tier's
`root_dir`), and a valkey tier whose TLS file cannot be read refused when it is built."""

from __future__ import annotations

import os

import pytest

from kvtier import build_hierarchy, load_config_text
from kvtier.cli.main import main
from kvtier.core.errors import ConfigError
from kvtier.testing.fake_remote import FakeServer
from kvtier.tiers.remote.backend import ValkeyBackend

SECRET = "env-check-s3cret"


def valkey_yaml(options: str) -> str:
    return ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: shared, backend: valkey, capacity: 64 blocks, url: 'rediss://127.0.0.1:6380'{options}}}\n")


def file_yaml(root_dir: str) -> str:
    return ("block_bytes: 4KiB\ntiers:\n  - {name: cpu, backend: memory, capacity: 8 blocks}\n"
            f"  - {{name: nvme, backend: file, capacity: 64 blocks, root_dir: '{root_dir}'}}\n")


def check(tmp_path, text: str, capsys, *flags: str) -> tuple[int, str, str]:
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    code = main(["config", "check", str(path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_password_variable_is_looked_up_only_with_env(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVT_ENV_PW", raising=False)
    text = valkey_yaml(", password_env: KVT_ENV_PW")
    assert check(tmp_path, text, capsys)[0] == 0  # the file alone is valid (it may run elsewhere)
    code, out, err = check(tmp_path, text, capsys, "--env")
    assert code == 2
    assert "tiers[1].password_env: the environment variable KVT_ENV_PW is not set" in err
    monkeypatch.setenv("KVT_ENV_PW", SECRET)
    code, out, err = check(tmp_path, text, capsys, "--env")
    assert "tiers[1] shared: 1 problem(s); password found (not shown)" in out and SECRET not in out + err
    # found, then sent to the url, where no server listens (tests/test_cli_env_check.py: real servers)
    assert code == 2 and "tiers[1].password_env" not in err and "tiers[1].url: server 127.0.0.1:6380" in err


def test_a_password_file_readable_by_others_is_reported(tmp_path, capsys):
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o644)
    code, _, err = check(tmp_path, valkey_yaml(f", password_file: '{secret}'"), capsys, "--env")
    assert code == 2 and "tiers[1].password_file" in err and "chmod 600" in err and SECRET not in err


def test_tls_files_that_cannot_be_read_are_named(tmp_path, capsys):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "certs").mkdir()
    text = valkey_yaml(f", tls_ca_file: '{ca}', tls_cert_file: '{tmp_path / 'certs'}', "
                       f"tls_key_file: '{tmp_path / 'missing.key'}'")
    code, out, err = check(tmp_path, text, capsys, "--env")
    assert code == 2
    assert "tiers[1].tls_cert_file" in err and "is not a regular file" in err
    assert "tiers[1].tls_key_file" in err and "missing.key does not exist" in err
    assert "tiers[1].tls_ca_file" not in err


def test_a_valkey_tier_with_an_unreadable_tls_file_is_refused_when_built(tmp_path, monkeypatch):
    """Before, the build succeeded and every connection failed: each lookup a silent miss."""
    server = FakeServer()
    monkeypatch.setattr(ValkeyBackend, "store_factory", server.store)
    config = load_config_text(valkey_yaml(f", tls_ca_file: '{tmp_path / 'nowhere.pem'}'"))
    with pytest.raises(ConfigError) as info:
        build_hierarchy(config, model="m")
    assert "tiers[1].tls_ca_file" in str(info.value) and "does not exist" in str(info.value)


def test_a_root_dir_to_be_created_is_checked_and_not_created(tmp_path, capsys):
    root = tmp_path / "a" / "b" / "tier"
    code, out, err = check(tmp_path, file_yaml(str(root)), capsys, "--env")
    assert code == 0, err
    assert f"root_dir {root}: would be created in {tmp_path}" in out
    assert not (tmp_path / "a").exists()


def test_an_existing_root_dir_is_checked_as_the_tier_opens_it(tmp_path, capsys):
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    code, out, _ = check(tmp_path, file_yaml(str(root)), capsys, "--env")
    assert code == 0 and f"root_dir {root}: exists" in out
    root.chmod(0o777)
    code, _, err = check(tmp_path, file_yaml(str(root)), capsys, "--env")
    assert code == 2 and "tiers[1].root_dir" in err and "writable by group or others" in err
    root.chmod(0o700)
    os.symlink("/etc/passwd", root / "slab.0")
    code, _, err = check(tmp_path, file_yaml(str(root)), capsys, "--env")
    assert code == 2 and "is a symlink" in err
    assert os.path.islink(root / "slab.0")  # reported, not removed


def test_a_root_dir_that_is_a_file_or_under_an_open_directory_is_reported(tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.write_text("")
    code, _, err = check(tmp_path, file_yaml(str(plain / "tier")), capsys, "--env")
    assert code == 2 and "not a directory" in err
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    code, _, err = check(tmp_path, file_yaml(str(open_dir / "tier")), capsys, "--env")
    assert code == 2 and "writable by everyone without the sticky bit" in err
    assert not (open_dir / "tier").exists()


def test_a_root_dir_that_resolves_too_long_is_reported_as_the_build_would(tmp_path, capsys):
    """A short root_dir through a symlink of yours into a directory so deep that the tier's files
    would not fit in PATH_MAX: the build refuses it, so `--env` must too (it said "exists")."""
    from kvtier.tiers.file.rootdir import LONGEST_FILE, PATH_MAX

    deep = PATH_MAX - len(LONGEST_FILE) - 1  # then `deep/LONGEST_FILE` is PATH_MAX bytes: too long
    target, fd = str(tmp_path), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while len(target) < deep:
            name = "d" * min(200, deep - len(target) - 1)
            os.mkdir(name, dir_fd=fd)
            fd, old = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(old)
            target += "/" + name
    finally:
        os.close(fd)
    os.symlink(target, tmp_path / "deep")
    for root in (tmp_path / "deep", tmp_path / "deep" / "new"):  # existing, and to be created
        code, _, err = check(tmp_path, file_yaml(str(root)), capsys, "--env")
        assert code == 2 and "too long a path for the files in it" in err, err


@pytest.mark.parametrize("gds, expected", [(False, "engine<->file staged (no nvidia-fs driver"),
                                           (True, "engine<->file direct (GPUDirect Storage")])
def test_env_says_which_engine_file_path_a_file_tier_takes_and_why(tmp_path, capsys, monkeypatch, gds, expected):
    from kvtier.tiers.file import fileio

    monkeypatch.setattr(fileio, "gpu_present", lambda: True)
    monkeypatch.setattr(fileio, "kvikio_importable", lambda: True)
    monkeypatch.setattr(fileio, "gds_platform", lambda: gds)
    code, out, _ = check(tmp_path, file_yaml(str(tmp_path / "kv")), capsys, "--env")
    assert code == 0 and expected in out
