"""The options of the shared tier: the YAML options of a `valkey` tier (their validators, the
checks between them and against the environment) and `ClientOptions`, what the client is built from.

The password never appears in a config: `password_env` names an environment variable that holds
it, or `password_file` a file (yours, not readable by group or others) whose first line it is
(password.py resolves it). A `url` with credentials in it is refused (url.py: its forms).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.identity import fingerprint_option
from kvtier.core.quoting import brief
from kvtier.core.types import REQUIRED
from kvtier.tiers.remote.keys import validate_key_prefix
from kvtier.tiers.remote.password import resolve_password
from kvtier.tiers.remote.url import ParsedUrl, parse_url, redact_url

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def _their_check(check: Any, value: Any, field: str) -> Any:
    """Run a `kvtier.tiers.remote` validator (light: no client library), without its field prefix."""
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
    "fingerprint": ("", fingerprint_option),
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


@dataclass(frozen=True)
class ClientOptions:
    """How `RemoteStore` reaches its server(s). Validated when built (ValueError naming the field).

    `timeout_s` bounds every socket read and write of the data path and of probes; the client never
    retries (a retry would double the time a lookup can wait). After `breaker_failures` consecutive
    failures of one server its circuit breaker opens for `breaker_open_s` (see breaker.py).
    """

    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # already resolved; never printed
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    timeout_s: float = 0.25
    connect_timeout_s: float = 0.25
    breaker_failures: int = 3
    breaker_open_s: float = 5.0

    def __post_init__(self) -> None:
        parsed = parse_url(self.url)
        for name in ("timeout_s", "connect_timeout_s", "breaker_open_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 3600:
                raise ValueError(f"{name}: expected seconds > 0 and < 3600, got {value!r}")
        if isinstance(self.breaker_failures, bool) or not isinstance(self.breaker_failures, int) \
                or self.breaker_failures < 1:
            raise ValueError(f"breaker_failures: expected an integer >= 1, got {self.breaker_failures!r}")
        for name in ("username", "password", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                shown = "<hidden>" if name == "password" else repr(value)
                raise ValueError(f"{name}: expected a non-empty string or None, got {shown}")
        if not parsed.tls:
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: TLS options need a TLS URL (rediss:// or clusters://), "
                                     f"url is {self.url!r}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file, tls_key_file: a client certificate needs both (or neither)")
        if self.username is not None and self.password is None:
            raise ValueError("password: a username needs a password (ACL users authenticate with both)")

    @property
    def parsed(self) -> ParsedUrl:
        return parse_url(self.url)

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    def redacted(self) -> dict:
        """The options for logs and `config check`: everything but the password (only whether one is set)."""
        return {"url": self.url, "username": self.username, "password_set": self.password is not None,
                "tls_ca_file": self.tls_ca_file, "tls_cert_file": self.tls_cert_file,
                "tls_key_file": self.tls_key_file, "tls_verify": self.tls_verify, "timeout_s": self.timeout_s,
                "connect_timeout_s": self.connect_timeout_s, "breaker_failures": self.breaker_failures,
                "breaker_open_s": self.breaker_open_s}
