"""`kvtier config check --env` for a valkey tier: reach its server, authenticate, try its namespace.

The build of a valkey tier never fails on a server that is down or refuses it (a shared tier that
cannot be reached is a miss, see `ValkeyBackend`), so without this check a wrong password or a dead
port only shows at run time as `probe_failures`. Here the server(s) of the `url` are asked once,
with the tier's `timeout_ms` for connecting and for the reply, with the tier's client
(`kvtier.tiers.remote.nodes`, the Redis client library imported only here):

- one PING per server named in the url (each seed of a cluster): connect, TLS handshake, AUTH;
- then, in one round trip, CLUSTER KEYSLOT (whether the server is in cluster mode: an integer, or
  "cluster support disabled") and, on a single server, one EXISTS of a key under `key_prefix`
  (nothing is written): an ACL user that may PING but not use the tier's keys is refused here
  (NOPERM) as its GETs and SETs would be. A `cluster://` seed not in cluster mode (the tier could
  never load a slot map: every call a miss) and a `redis://` / `unix://` server in cluster mode
  (MOVED for every key of the slots it does not hold) are problems on `url`, even when other seeds
  of the cluster answered; a server that refuses or does not know CLUSTER KEYSLOT is not judged.

The servers are asked at once (one thread each) and the whole check ends within
`ANSWER_ROUNDS` x `timeout_ms` (+ `SLACK_S`), however many seeds the url names: a server that sends
a reply byte by byte, so that no single read times out, is reported as a timeout too.

A failure is a problem on the field to fix, naming the cause: connection refused, timeout,
authentication required or failed (`errors.authentication_problem`), NOPERM, TLS, the wrong cluster
mode. The password is never part of a message.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tiers.remote.errors import authentication_problem, without_echo
from kvtier.tiers.remote.password import resolve_password

# Round trips one server's check may take: connect, the handshake (AUTH / HELLO), PING, then CLUSTER
# KEYSLOT and EXISTS (one write).
ANSWER_ROUNDS = 4
SLACK_S = 0.5

# redis-py exception class name -> (field to fix, what it means)
_CAUSES = {
    "AuthenticationWrongNumberOfArgsError": ("password", "authentication failed (the server has no ACL users)"),
    "NoPermissionError": ("username", "NOPERM: the ACL user may not run this command or use these keys"),
    "TimeoutError": ("url", "timeout"),
    "InvalidResponse": ("url", "the answer is not the Redis protocol (is a valkey server listening there?)"),
}


def reach(options: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """(notes, problems as `(option name, message)`) of reaching the tier's server(s) once."""
    try:
        password = resolve_password(options.get("password_env"), options.get("password_file"))
    except ConfigError as exc:  # reported by options.check_environment
        return [], list(exc.problems)
    try:
        import kvtier.tiers.remote.nodes  # noqa: F401 - the Redis client library, imported here to report its absence
        from kvtier.tiers.remote.options import ClientOptions
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
    key = None if parsed.cluster else f"{options.get('key_prefix', 'kvt')}:kvtier-config-check".encode()
    outcomes: dict[str, BaseException | None] = {}
    threads = [threading.Thread(target=_ask, args=(client, parsed, endpoint, key, outcomes), daemon=True,
                                name=f"kvtier-check-{endpoint.name}") for endpoint in parsed.endpoints]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + ANSWER_ROUNDS * timeout_s + SLACK_S
    for thread in threads:  # a thread still reading at the deadline is left behind (daemon)
        thread.join(max(0.0, deadline - time.monotonic()))
    return _verdict(options, parsed, outcomes, timeout_s, client.password)


def _verdict(options: dict, parsed: Any, outcomes: dict, timeout_s: float,
             password: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """`reach`'s result from each server's outcome (absent: unfinished). A server in the wrong
    cluster mode is a problem even when other seeds of a cluster answered; a seed that did not
    answer is only a note then (a cluster is reached through any of its seeds)."""
    answered, problems, wrong_mode = [], [], []
    for endpoint in parsed.endpoints:
        outcome = outcomes.get(endpoint.name, _Unfinished("the reply was still incomplete"))
        if outcome is None:
            answered.append(endpoint.name)
        elif isinstance(outcome, _WrongMode):
            wrong_mode.append(("url", f"server {endpoint.name}: {outcome}"))
        else:
            problems.append(_problem(options, endpoint.name, outcome, timeout_s, password))
    if parsed.cluster and answered:
        notes = [f"no answer from {message}" for _field, message in problems]
        return [f"cluster seed(s) {', '.join(answered)} answered PING"] + notes, wrong_mode
    if problems or wrong_mode:
        return [], wrong_mode + problems
    return [f"{', '.join(answered)} answered PING and EXISTS as {options.get('username') or 'the default user'}"], []


class _Unfinished(Exception):
    """A server whose answers did not end in time (e.g. sent byte by byte): reported as a timeout."""


class _WrongMode(Exception):
    """A server whose cluster mode is not the url's; its text says what is wrong and what is right."""


def _mode_problem(parsed: Any, endpoint: Any, keyslot: Any) -> _WrongMode | None:
    """The problem of a server whose answer to CLUSTER KEYSLOT is `keyslot` (an integer in cluster
    mode, an error saying "cluster support disabled" otherwise; anything else is not judged)."""
    in_cluster = isinstance(keyslot, int)
    if parsed.cluster and not in_cluster and "cluster support disabled" in str(keyslot):
        single = "rediss" if parsed.tls else "redis"
        return _WrongMode(f"not in cluster mode (cluster-enabled no): a {'clusters' if parsed.tls else 'cluster'}:// "
                          f"url names nodes of a cluster, and this server has no slot map to give (every call of "
                          f"the tier would be a miss); for this single server use {single}://{endpoint.name}, or "
                          f"name the nodes of a cluster")
    if not parsed.cluster and in_cluster:
        where = "HOST:PORT" if endpoint.unix_path else endpoint.name
        return _WrongMode(f"in cluster mode (cluster-enabled yes): a {'rediss' if parsed.tls else 'redis'}:// or "
                          f"unix:// url uses this one node, which answers MOVED for the keys of every slot it does "
                          f"not hold (those calls would fail); use {'clusters' if parsed.tls else 'cluster'}://"
                          f"{where}, naming one or more nodes of the cluster")
    return None


def _ask(client: Any, parsed: Any, endpoint: Any, key: bytes | None, outcomes: dict) -> None:
    """PING one server, then ask CLUSTER KEYSLOT (and EXISTS `key` unless None) in one round trip;
    its outcome into `outcomes`: None (answered), a `_WrongMode` (`_mode_problem`), or the error."""
    import redis

    from kvtier.tiers.remote.nodes import NodeClient

    node = NodeClient(client, endpoint, tls=parsed.tls, db=parsed.db)
    try:
        node.ping()
        probe = key if key is not None else b"kvtier-config-check"
        replies = node.ask([[b"CLUSTER", b"KEYSLOT", probe]] + ([[b"EXISTS", key]] if key is not None else []))
        wrong = _mode_problem(parsed, endpoint, replies[0])
        if wrong is not None:
            raise wrong
        for reply in replies[1:]:  # EXISTS: an integer, or its error (NOPERM, NOAUTH, ...)
            if isinstance(reply, Exception):
                raise reply
            if not isinstance(reply, int):
                raise redis.ConnectionError(f"EXISTS reply: unexpected {reply!r:.32}")
        outcomes[endpoint.name] = None
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its cause
        outcomes[endpoint.name] = exc
    finally:
        node.close()


def _problem(options: dict, where: str, exc: BaseException, timeout_s: float,
             password: str | None) -> tuple[str, str]:
    """The field to fix and the message for one failed server (never holding `password`)."""
    kind = type(exc).__name__
    field, cause = _CAUSES.get(kind, ("url", ""))
    text = _redact(str(exc), password)
    if kind == "AuthenticationError":  # (what is wrong and what is right; the server's text is in it)
        problem = authentication_problem(_short(text), password is not None)
        return _password_field(options), f"server {where}: {problem} ({kind})"
    if kind == "TimeoutError":
        cause = f"timeout: no answer within timeout_ms ({timeout_s * 1000:g} ms)"
    elif kind == "_Unfinished":
        cause = (f"timeout: no complete answer within {ANSWER_ROUNDS} x timeout_ms "
                 f"({ANSWER_ROUNDS * timeout_s * 1000:g} ms)")
        kind = "TimeoutError"
    elif not cause and ("SSL" in text or "certificate" in text or "TLS" in text):
        field, cause = ("tls_ca_file" if options.get("tls_ca_file") else "url"), "TLS handshake failed"
    elif not cause and ("reply: unexpected" in text or "no end of line" in text):  # kvtier.tiers.remote.nodes' reader
        cause = _CAUSES["InvalidResponse"][1]
    elif not cause and "unknown command" in text.lower():
        cause = "the server does not know a command sent (AUTH renamed or disabled there? a valkey server?)"
    elif not cause and "refused" in text.lower():
        cause = "connection refused (no server listening there)"
    elif not cause:
        cause = "cannot connect"
    if field == "password":
        field = _password_field(options)
    if field == "username" and not options.get("username"):
        field = "key_prefix"  # the default user may not use these keys
    return field, f"server {where}: {cause} ({kind}: {_short(text)})"


def _password_field(options: dict) -> str:
    """The option a password problem is reported on: the one that gave it, else `password_env`."""
    return next((name for name in ("password_file", "password_env") if options.get(name)), "password_env")


def _redact(text: str, password: str | None) -> str:
    """`text` of a server's error without the password (`without_echo`: the arguments a server
    quotes of a command it does not know, AUTH's among them)."""
    text = without_echo(text)
    return text.replace(password, "<hidden>") if password else text


def _short(text: Any) -> str:
    text = str(text)
    return text if len(text) <= 300 else text[:297] + "..."
