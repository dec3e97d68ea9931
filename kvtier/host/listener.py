"""The owner's Unix socket: in a directory only its user can enter, 0600, one owner per path.

`listen(path)` refuses a directory that is a symlink, belongs to another user or lets others in,
refuses a path where a live owner answers (`OwnerRunning`), replaces a socket left by a dead one,
and never removes anything that is not a socket of this user. `peer_uid` is the connecting
process's user (SO_PEERCRED): the owner serves only its own user, whatever the file modes say.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct

from kvtier.core.errors import KVTierError

_LISTEN_BACKLOG = 64
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class OwnerRunning(KVTierError):
    """Another owner already listens on this socket path."""


class UnsafeSocketPath(KVTierError, ValueError):
    """The socket's directory or path is not private to this user, or cannot be made."""


def private_directory(directory: str) -> None:
    """Create `directory` (0700) if absent; `UnsafeSocketPath` unless it is a real directory of
    this user that no one else may enter."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:  # (a missing parent, a read-only or unwritable one)
        raise UnsafeSocketPath(f"cannot create {directory} for the kvtier host socket: {exc.strerror}; create "
                               f"{os.path.dirname(directory) or '.'} first or choose another socket path") from None
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPath(f"{directory} must be a directory (not a symlink) for the kvtier host socket")
    if st.st_uid != os.getuid():
        raise UnsafeSocketPath(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                               f"choose a socket path in a directory of your own")
    if st.st_mode & 0o077:
        raise UnsafeSocketPath(f"{directory} has mode {stat.S_IMODE(st.st_mode):o}: other users may enter it; "
                               f"chmod 700 it or choose another socket path")


def _answers(path: str) -> bool:
    """Whether an owner listens at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()


def _clear_stale(path: str) -> None:
    """Remove a socket of this user left at `path` by an owner that is gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise UnsafeSocketPath(f"{path} exists and is not a socket of this user: not touching it")
    if _answers(path):
        raise OwnerRunning(f"a kvtier host owner already listens on {path}")
    os.unlink(path)


def listen(path: str) -> socket.socket:
    """A listening socket at `path`, mode 0600, in a private directory (the module docstring)."""
    private_directory(os.path.dirname(path))
    _clear_stale(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)  # the socket is created 0600: no window where it is wider
        try:
            server.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        server.listen(_LISTEN_BACKLOG)
    except BaseException:
        server.close()
        raise
    return server


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(data)[1]
