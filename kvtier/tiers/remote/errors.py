"""What a remote store call raises. All are `TransferError`s: one job fails, the caller recomputes.

`BlockMissing` and `ValueRejected` are answers of a live server (the key is gone, the value is not
ours or is damaged): they never count toward the circuit breaker. `RemoteUnavailable` is a server
that did not answer in time, refused the connection or the command, or a breaker that is open.
"""

from __future__ import annotations

from kvtier.core.errors import TransferError

_ECHO = "with args beginning with"  # how Redis/Valkey quote a command they do not know, arguments and all


def without_echo(text: str) -> str:
    """`text` (a server's error) with the arguments it quotes hidden: a server that does not know
    AUTH (renamed or disabled there, a proxy) answers "unknown command 'AUTH', with args beginning
    with: '<the password>'". Every message built from a server's error goes through this."""
    at = text.find(_ECHO)
    return text if at < 0 else text[:at] + _ECHO + ": <hidden>"


def authentication_problem(text: str, password_given: bool) -> str:
    """What an authentication refusal means and how to fix it, for a log line or a problem of
    `config check` (never holding a secret: `text`, the server's error, goes through `without_echo`).
    Without a password: the server requires one (NOAUTH). With one: the server refused it
    (WRONGPASS: wrong password or username, or a disabled user), or it has none to check it against
    (AUTH sent to a server without a password)."""
    said = without_echo(text)
    if not password_given:
        return (f"authentication required: the server requires a password and none is given (NOAUTH: {said}); "
                f"give it with the tier's password_env (an environment variable) or password_file option, "
                f"and username for an ACL user")
    if "without any password configured" in said or "no password is set" in said:
        return (f"authentication failed: a password is given but the server has none set for the default user "
                f"({said}); give the username of its ACL user, or drop password_env / password_file")
    return (f"authentication failed: the server refused the username and password given (WRONGPASS: {said}); "
            f"check the password that password_env or password_file holds, and username")


class RemoteUnavailable(TransferError):
    """The server (or the shard that holds a key) cannot be used now: down, timed out, refused
    (authentication, ACL permission), full (`OOM command not allowed` on a write), or the circuit
    breaker is open (raised at once, without socket I/O). `cause`: the name of what went wrong
    (`AuthenticationError`, `NoPermissionError`, `TimeoutError`, `ConnectionError`, `SlowAnswer`,
    `BreakerOpen`, ...), "" when not known."""

    def __init__(self, message: str, cause: str = ""):
        super().__init__(without_echo(message))
        self.cause = cause


class ValueRejected(TransferError):
    """A value read back failed verification: written by another model, layout or tenant, under
    another key, truncated, corrupted, or not a string. Its bytes are never served."""


class BlockMissing(TransferError):
    """A key that should exist is gone (evicted by the server, or never fully written)."""
