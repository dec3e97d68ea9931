"""`kvtier config check --env` for a valkey tier: reach its server, authenticate, try its namespace.

The build of a valkey tier never fails on a server that is down or refuses it (a shared tier that
cannot be reached is a miss, see `ValkeyBackend`), so without this check a wrong password or a dead
port only shows at run time as `probe_failures`. Here the server(s) of the `url` are asked once,
with the tier's `timeout_ms` for connecting and for the reply, with the tier's client
(`kvtier.remote.nodes`, the Redis client library imported only here):

- one PING per server named in the url (each seed of a cluster): connect, TLS handshake, AUTH;
- on a single server, one EXISTS of a key under `key_prefix` (nothing is written): an ACL user that
  may PING but not use the tier's keys is refused here (NOPERM) as its GETs and SETs would be.

A failure is a problem on the field to fix, naming the cause: connection refused, timeout,
authentication failed, NOPERM, TLS.
"""

from __future__ import annotations

from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.valkey_options import resolve_password

# redis-py exception class name -> (field to fix, what it means)
_CAUSES = {
    "AuthenticationError": ("password", "authentication failed (wrong username or password)"),
    "AuthenticationWrongNumberOfArgsError": ("password", "authentication failed (the server has no ACL users)"),
    "NoPermissionError": ("username", "NOPERM: the ACL user may not run this command or use these keys"),
    "TimeoutError": ("url", "timeout"),
}


def reach(options: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """(notes, problems as `(option name, message)`) of reaching the tier's server(s) once."""
    try:
        password = resolve_password(options.get("password_env"), options.get("password_file"))
    except ConfigError as exc:  # reported by valkey_options.check_environment
        return [], list(exc.problems)
    try:
        from kvtier.remote.nodes import NodeClient
        from kvtier.remote.options import ClientOptions
    except ImportError as exc:
        return [], [("backend", f"the valkey tier needs the Redis client library (pip install 'redis[hiredis]'): "
                                f"{exc}")]
    timeout_s = options.get("timeout_ms", 250) / 1000
    client = ClientOptions(url=options["url"], username=options.get("username"),
                           password=password.value if password else None, tls_ca_file=options.get("tls_ca_file"),
                           tls_cert_file=options.get("tls_cert_file"), tls_key_file=options.get("tls_key_file"),
                           tls_verify=options.get("tls_verify", True), timeout_s=timeout_s,
                           connect_timeout_s=timeout_s)
    parsed = client.parsed
    answered, problems = [], []
    for endpoint in parsed.endpoints:
        node = NodeClient(client, endpoint, tls=parsed.tls, db=parsed.db)
        try:
            node.ping()
            if not parsed.cluster:
                node.exists([f"{options.get('key_prefix', 'kvt')}:kvtier-config-check".encode()])
            answered.append(endpoint.name)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its cause
            problems.append(_problem(options, endpoint.name, exc, timeout_s))
        finally:
            node.close()
    if parsed.cluster and answered:  # a cluster is reached through any of its seeds
        notes = [f"no answer from {message}" for _field, message in problems]
        return [f"cluster seed(s) {', '.join(answered)} answered PING"] + notes, []
    if problems:
        return [], problems
    return [f"{', '.join(answered)} answered PING and EXISTS as {options.get('username') or 'the default user'}"], []


def _problem(options: dict, where: str, exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """The field to fix and the message for one failed server."""
    kind = type(exc).__name__
    field, cause = _CAUSES.get(kind, ("url", ""))
    text = str(exc)
    if kind == "TimeoutError":
        cause = f"timeout: no answer within timeout_ms ({timeout_s * 1000:g} ms)"
    elif not cause and ("SSL" in text or "certificate" in text or "TLS" in text):
        field, cause = ("tls_ca_file" if options.get("tls_ca_file") else "url"), "TLS handshake failed"
    elif not cause and "refused" in text.lower():
        cause = "connection refused (no server listening there)"
    elif not cause:
        cause = "cannot connect"
    if field == "password":
        given = [name for name in ("password_file", "password_env") if options.get(name)]
        field = given[0] if given else "password_env"
        if not given:
            cause = "the server requires a password: give password_env or password_file"
    if field == "username" and not options.get("username"):
        field = "key_prefix"  # the default user may not use these keys
    return field, f"server {where}: {cause} ({kind}: {_short(text)})"


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= 300 else text[:297] + "..."
