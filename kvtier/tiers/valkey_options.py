"""The YAML options of a `valkey` tier: their validators, the checks between them, and the password.

The password never appears in a config: `password_env` names an environment variable that holds
it, or `password_file` a file (yours, not readable by group or others) whose first line it is.
A `url` with credentials in it is refused. `Secret` keeps the resolved password out of every
repr, log line and `kvtier config check` output.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Any

from kvtier.config import REQUIRED
from kvtier.config_input import brief
from kvtier.errors import ConfigError
from kvtier.remote.keys import validate_key_prefix
from kvtier.remote.options import parse_url

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_MAX_SECRET_BYTES = 4096


class Secret:
    """A password: `value` is the text; `repr`/`str` never show it."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def _their_check(check: Any, value: Any, field: str) -> Any:
    """Run a `kvtier.remote` validator (light: no client library), without its field prefix."""
    try:
        return check(value, field)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message[len(field) + 2:] if message.startswith(f"{field}: ") else message) from None


def _url(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > 4096:
        raise ValueError(f"expected a server address such as 'redis://host:6379', 'rediss://host:6380' (TLS), "
                         f"'unix:///path.sock' or 'cluster://h1:p1,h2:p2' (cluster seeds), got {brief(v)}")
    _their_check(parse_url, v, "url")
    return v


def _text(what: str):
    def check(v: Any) -> str:
        if not isinstance(v, str) or not v or len(v) > 1024 or not v.isprintable():
            raise ValueError(f"expected {what}, got {brief(v)}")
        return v
    return check


def _env_name(v: Any) -> str:
    if not isinstance(v, str) or not _ENV_RE.match(v):
        raise ValueError("expected the NAME of an environment variable holding the password (letters, digits, "
                         "'_', not starting with a digit); the value given is not one (not shown: it may be a "
                         "password)")
    return v


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v or "\0" in v:
        raise ValueError(f"expected a file path, got {brief(v)}")
    return os.path.expanduser(v)


def _secret_path(v: Any) -> str:
    """A path with a '/' (absolute, ~/..., ./...): a bare word is more likely a pasted password than a
    file name, so it is refused without being shown."""
    if not isinstance(v, str) or "/" not in v or "\0" in v or not v.isprintable():
        raise ValueError("expected the path of a file holding the password, with a '/' (e.g. /run/secrets/valkey, "
                         "~/.valkey-pw or ./valkey-pw); the value given is not one (not shown: it may be a password)")
    return os.path.expanduser(v)


def _num(x: float) -> str:
    """`x` as written in a config: 1048576, not 1.04858e+06."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _prefix(v: Any) -> str:
    return _their_check(validate_key_prefix, v, "key_prefix")


def _number(low: float, high: float, what: str, integer: bool = False):
    def check(v: Any) -> Any:
        kinds = (int,) if integer else (int, float)
        if isinstance(v, bool) or not isinstance(v, kinds) or not low <= v <= high:
            kind = "an integer" if integer else "a number"
            raise ValueError(f"expected {kind} of {what} from {_num(low)} to {_num(high)}, got {brief(v)}")
        return v if integer else float(v)
    return check


def _positive(high: float, what: str):
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= high:
            raise ValueError(f"expected a number of {what} above 0 and at most {_num(high)}, got {brief(v)}")
        return float(v)
    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {brief(v)}")
    return v


def _fingerprint(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string identifying the model and KV layout, got {brief(v)}")
    return v


OPTIONS: dict[str, tuple[Any, Any]] = {
    "url": (REQUIRED, _url),
    "username": (None, _text("an ACL user name")),
    "password_env": (None, _env_name),
    "password_file": (None, _secret_path),
    "tls_ca_file": (None, _path),
    "tls_cert_file": (None, _path),
    "tls_key_file": (None, _path),
    "tls_verify": (True, _bool),
    "key_prefix": ("kvt", _prefix),
    "timeout_ms": (250, _number(1, 60_000, "milliseconds", integer=True)),
    "max_inflight_mib": (256.0, _positive(1 << 20, "MiB of writes in flight")),
    "breaker_failures": (3, _number(1, 1000, "consecutive failures", integer=True)),
    "breaker_open_s": (5.0, _positive(3600, "seconds")),
    "negative_ttl_s": (2.0, _number(0, 3600, "seconds")),
    "threads": (4, _number(1, 256, "I/O threads", integer=True)),
    "tp": (1, _number(1, 1024, "tensor-parallel ranks (one value per rank and block)", integer=True)),
    "fingerprint": ("", _fingerprint),
}


def check_options(options: dict) -> list[tuple[str, str]]:
    """Problems between options (`Backend.check_options`)."""
    problems = []
    if options.get("password_env") and options.get("password_file"):
        problems.append(("password_file", "give the password through password_env or password_file, not both"))
    tls = [k for k in TLS_FILES if options.get(k)]
    url = options.get("url")
    try:
        plain = isinstance(url, str) and not parse_url(url).tls
    except ValueError:  # reported on `url` itself
        plain = False
    if tls and plain:
        problems.append((tls[0], "TLS files are given but the url is not a TLS one; use rediss:// (or "
                                 "clusters:// for a cluster)"))
    if options.get("username") and not (options.get("password_env") or options.get("password_file")):
        problems.append(("username", "an ACL user needs a password: give password_env or password_file"))
    if bool(options.get("tls_cert_file")) != bool(options.get("tls_key_file")):
        missing = "tls_key_file" if options.get("tls_cert_file") else "tls_cert_file"
        problems.append((missing, "a client certificate needs both tls_cert_file and tls_key_file"))
    return problems


TLS_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def check_given(given: dict[str, Any], table: dict[str, tuple[Any, Any]]) -> None:
    """Validate options given directly to `ValkeyBackend` (not through a config): each one that is
    not None nor its default by its own check in `table`, then `check_options`; one `ConfigError`
    naming every option that is wrong."""
    problems = []
    for option, value in given.items():
        default, check = table[option]
        if value is None or value == default:
            continue
        try:
            check(value)
        except (ValueError, TypeError) as exc:
            problems.append((option, str(exc)))
    problems += check_options(given)
    if problems:
        raise ConfigError(problems)


def check_tls_files(options: dict) -> None:
    """`ConfigError` naming each TLS file option whose file cannot be read here: the client would
    fail every connection (each lookup a miss) instead of refusing the config."""
    problems = []
    for name in TLS_FILES:
        path = options.get(name)
        if not path:
            continue
        if not os.path.isfile(path):
            what = "does not exist" if not os.path.lexists(path) else "is not a regular file"
            problems.append((name, f"{path} {what}; give the PEM file the client reads"))
        elif not os.access(path, os.R_OK):
            problems.append((name, f"{path} is not readable by you; fix its permissions or run as its owner"))
    if problems:
        raise ConfigError(problems)


def check_environment(options: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """`Backend.check_environment`: the password the options point to, and the TLS files."""
    notes, problems = [], []
    for check in (lambda: resolve_password(options.get("password_env"), options.get("password_file")),
                  lambda: check_tls_files(options)):
        try:
            check()
        except ConfigError as exc:
            problems += exc.problems
    if not problems and (options.get("password_env") or options.get("password_file")):
        notes.append("password found (not shown)")
    if not problems and any(options.get(name) for name in TLS_FILES):
        notes.append("TLS files readable")
    return notes, problems


def resolve_password(password_env: str | None, password_file: str | None) -> Secret | None:
    """The password the options point to (None without one); `ConfigError` naming the option when
    the variable is unset or the file is missing, not yours, or readable by group or others."""
    if password_env:
        value = os.environ.get(password_env)
        if not value:
            raise ConfigError([("password_env", f"the environment variable {password_env} is not set (or empty); "
                                                f"export the server password there")])
        return Secret(value)
    if password_file:
        return Secret(_read_secret_file(password_file))
    return None


def _read_secret_file(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError([("password_file", f"{path} is a symlink; give the file itself (symlinks are refused "
                                                 f"so that no one can point it elsewhere)")]) from None
        raise ConfigError([("password_file", f"cannot open {path}: {exc.strerror or exc} (a regular file, not a "
                                             f"symlink, holding the password)")]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError([("password_file", f"{path} is not a regular file")])
        if st.st_uid != os.geteuid():
            raise ConfigError([("password_file", f"{path} is not owned by you; its owner could change the password "
                                                 f"kvtier sends")])
        if st.st_mode & 0o077:
            raise ConfigError([("password_file", f"{path} is readable or writable by group or others (mode "
                                                 f"{stat.S_IMODE(st.st_mode):o}); run 'chmod 600 {path}'")])
        data = os.read(fd, _MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_BYTES:
        raise ConfigError([("password_file", f"{path} is larger than {_MAX_SECRET_BYTES} bytes; it must hold the "
                                             f"password only")])
    text = data.decode("utf-8", "replace").splitlines()
    if not text or not text[0]:
        raise ConfigError([("password_file", f"{path} is empty; its first line must be the password")])
    return text[0]
