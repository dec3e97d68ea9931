"""The password of a shared tier, resolved from `password_env` or `password_file`, never shown.

`Secret` keeps the resolved password out of every repr, log line and `kvtier config check` output.
"""

from __future__ import annotations

import errno
import os
import stat

from kvtier.core.errors import ConfigError

_MAX_SECRET_BYTES = 4096


class Secret:
    """A password: `value` is the text; `repr`/`str` never show it."""

    __slots__ = ("value",)

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


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
