"""Where the file tier keeps its files, and how it opens them.

Threat model: the config author is trusted; other local users and whatever is found in `root_dir`
are not. So:

- `expand_root_dir` (the `root_dir` option's parser): `~` and `$VAR`/`${VAR}` are expanded; a `$`
  left over (an unset variable), a NUL, a name longer than 255 bytes or a path too long for the
  tier's files is refused.
- `prepare_root` creates what is missing of `root_dir`, each new directory 0700, and refuses:
  a path component that is not a directory; a symlink on the path owned by another user (yours and
  root's are followed, so `~/.cache` may be a link; one planted in a shared directory such as /tmp is
  not); a world-writable ancestor without the sticky bit (anyone could swap `root_dir` for another
  directory); a `root_dir` not owned by you or writable by group/others.
- `check_entries`: the tier's own names in `root_dir` are absent, or regular files (never symlinks,
  FIFOs, devices, nor a file with a second name: a hard link) owned by you and not writable by
  group/others (`check_owner`; `kvtier clear` asks the same of what it removes).
- `open_existing` / `create_new` / `open_or_create`: every open is `O_NOFOLLOW` (relative to a
  directory descriptor where one is given), checked again with `fstat` (a file of yours that
  group/others may read is made 0600); new files are created `O_EXCL`, 0600.

Every refusal is a `ConfigError` on the field `root_dir` (the hierarchy builder prefixes
`tiers[i].`) that names the path, its owner and mode, and what to do. The lock that makes a process
the tier's one user is rootlock.py.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from kvtier.core.errors import ConfigError
from kvtier.tiers.file.mounts import kernel_filesystem_problem

# The tier's files in root_dir. With TEMPORARIES, OWN_FILES is all that the tier writes there.
MANIFEST = "manifest.json"
SLAB = "slab.0"
JOURNAL = "journal"
LOCK = "lock"
TMP = ".tmp"  # suffix of the file a manifest or journal is written to before it replaces the old one
OWN_FILES = (LOCK, MANIFEST, SLAB, JOURNAL)
TEMPORARIES = (MANIFEST + TMP, JOURNAL + TMP)  # never opened: a leftover is unlinked and created afresh

FIELD = "root_dir"
NAME_MAX = 255
PATH_MAX = 4096  # including the terminating NUL
LONGEST_FILE = max(OWN_FILES + TEMPORARIES, key=len)  # the longest name the tier creates in root_dir
ADVICE = "choose a directory of your own, e.g. ~/.cache/kvtier/<tier>"
OPEN_TRIES = 16  # open_or_create: a file removed and created by others this often in a row is an attack


def refuse(message: str) -> ConfigError:
    """The error for an unusable `root_dir` (raise it)."""
    return ConfigError([(FIELD, message)])


def expand_root_dir(value) -> str:
    """`value` with `~` and environment variables expanded; ValueError if it cannot be a root_dir."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a directory path for the slab files, got {value!r}")
    if len(value) > 16 * PATH_MAX:  # before anything reads it (the checks below are linear, but not cheap)
        raise ValueError(f"{value[:80]!r}...: {len(value)} characters, far longer than any path (at most "
                         f"{PATH_MAX - 1} bytes)")
    if "\0" in value:
        raise ValueError(f"{value[:80]!r} contains a NUL character; give a directory path")
    path = os.path.expanduser(os.path.expandvars(value))
    if "$" in path:
        raise ValueError(f"{value[:200]!r}: {_unset_variable(path)} is not set in the environment; set it, or "
                         f"write the path out (a '$' in root_dir must name a set variable)")
    raw = os.fsencode(path)
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > NAME_MAX:
        raise ValueError(f"{path[:80]!r}...: a path component of {longest} bytes; at most {NAME_MAX} per "
                         f"component")
    if len(raw) + 1 + len(LONGEST_FILE) >= PATH_MAX:
        raise ValueError(f"{path[:80]!r}...: a path of {len(raw)} bytes is too long for the files in it; at "
                         f"most {PATH_MAX - 2 - len(LONGEST_FILE)} bytes")
    return path


def _unset_variable(path: str) -> str:
    start = path.index("$")
    end = start + 1
    while end < len(path) and (path[end].isalnum() or path[end] in "_{}"):
        end += 1
    return path[start:end] or "$"


# ---------------------------------------------------------------------------- the directory
def prepare_root(root: str) -> tuple[Path, list[Path]]:
    """Check `root` (created where missing) for a tier's files; returns the resolved directory and
    the directories created here, outermost first (remove them, innermost first, if the build fails).

    Raises `ConfigError` (field `root_dir`) if the directory is unsafe or cannot be created.
    """
    absolute = os.path.join(os.getcwd(), root)
    if problem := kernel_filesystem_problem(absolute):
        raise refuse(f"{root}: {problem}; {ADVICE}")
    created: list[Path] = []
    try:
        _walk(absolute, created)
        resolved = Path(os.path.realpath(absolute))
        _check_length(resolved, root)
        _check_ancestors(resolved)
        _check_directory(resolved, root)
    except BaseException:
        remove_dirs(created)
        raise
    return resolved, created


def _check_length(resolved: Path, root: str) -> None:
    if len(os.fsencode(str(resolved / LONGEST_FILE))) >= PATH_MAX:
        raise refuse(f"{root} resolves to {resolved}, too long a path for the files in it; use a shorter path")


def _walk(absolute: str, created: list[Path] | None) -> str | None:
    """lstat each prefix of `absolute` as written, creating the missing ones (0700); with
    `created` None, create nothing and return the first missing prefix (None: all exist)."""
    prefix = "/"
    for part in absolute.split("/"):
        if part in ("", "."):
            continue
        prefix = os.path.join(prefix, part)
        try:
            st = os.lstat(prefix)
        except FileNotFoundError:
            if created is None:
                return prefix
            _mkdir(prefix, absolute, created)
            continue
        except OSError as exc:
            raise refuse(f"cannot use {absolute}: {_os_reason(exc, prefix)}") from exc
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (os.geteuid(), 0):
                raise refuse(f"{prefix} (on the path of {absolute}) is a symlink owned by {owner_name(st.st_uid)}, who "
                             f"could point it anywhere; kvtier follows only symlinks owned by you or root. "
                             f"Remove it, or {ADVICE}")
            if not os.path.isdir(prefix):
                raise refuse(f"{prefix} (on the path of {absolute}) is a symlink to {os.path.realpath(prefix)}, "
                             f"which is not a directory; {ADVICE}")
        elif not stat.S_ISDIR(st.st_mode):
            raise refuse(f"{prefix} (on the path of {absolute}) is {file_kind(st.st_mode)}, not a directory; give "
                         f"the path of a directory (it is created when missing)")
    return None


def _mkdir(path: str, root: str, created: list[Path]) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # made meanwhile by someone else: checked like any existing directory
        return
    except OSError as exc:
        raise refuse(f"cannot create {root}: {_os_reason(exc, path)}") from exc
    created.append(Path(path))
    os.chmod(path, 0o700)  # whatever the umask


def _check_ancestors(resolved: Path) -> None:
    """No ancestor of `root_dir` may let other users rename entries (world-writable, not sticky)."""
    _check_parents(resolved, resolved.parents)


def _check_parents(resolved: Path, parents) -> None:
    for parent in parents:
        st = os.stat(parent)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise refuse(f"{parent}, a parent of root_dir {resolved}, is writable by everyone without the "
                         f"sticky bit (mode {_mode(st.st_mode)}): any user could replace root_dir. Run "
                         f"'chmod o-w {parent}' (or +t), or {ADVICE}")


def _check_directory(resolved: Path, root: str) -> None:
    """The final directory must be yours and not writable by group/others."""
    fd = os.open(resolved, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    check_directory(st, root, resolved)


def check_directory(st: os.stat_result, root: str, resolved: Path) -> None:
    """Refuse (`ConfigError` on `root_dir`) a tier directory (`st`: its stat, taken through the
    descriptor that is then used) that is not yours or that group/others may write to."""
    shown = f"{root}" if str(resolved) == root else f"{root} (= {resolved})"
    if st.st_uid != os.geteuid():
        raise refuse(f"{shown} is owned by {owner_name(st.st_uid)} (mode {_mode(st.st_mode)}), not by you "
                     f"({owner_name(os.geteuid())}): its owner could read or replace the tier's files; {ADVICE}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        shared = st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH  # perhaps /tmp itself
        fix = (f"If it is the tier's own, run 'chmod 700 {resolved}'; if it is shared by its users (sticky, like "
               f"/tmp), leave it as it is and {ADVICE}" if shared else f"Run 'chmod 700 {resolved}', or {ADVICE}")
        raise refuse(f"{shown} is writable by group or others (mode {_mode(st.st_mode)}, owner "
                     f"{owner_name(st.st_uid)}): they could plant or swap the tier's files. {fix}")


def inspect_root(root: str) -> str:
    """What `prepare_root(root)` and the tier's opening checks would find, changing nothing (for
    `kvtier config check --env`): the same `ConfigError` where they would refuse, else a line
    saying whether `root_dir` exists or would be created."""
    absolute = os.path.join(os.getcwd(), root)
    if problem := kernel_filesystem_problem(absolute):
        raise refuse(f"{root}: {problem}; {ADVICE}")
    missing = _walk(absolute, None)
    if missing is not None:
        parent = Path(os.path.realpath(os.path.dirname(missing)))
        _check_length(parent / os.path.relpath(absolute, os.path.dirname(missing)), root)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise refuse(f"cannot create {root}: {parent} is not writable by you ({owner_name(os.geteuid())}); "
                         f"{ADVICE}")
        _check_parents(Path(absolute), [parent, *parent.parents])
        return f"{root}: would be created in {parent}"
    resolved = Path(os.path.realpath(absolute))
    _check_length(resolved, root)
    _check_ancestors(resolved)
    _check_directory(resolved, root)
    if not os.access(resolved, os.W_OK | os.X_OK):
        raise refuse(f"{root} is not writable by you (mode {_mode(os.stat(resolved).st_mode)}); run 'chmod 700 "
                     f"{resolved}', or {ADVICE}")
    check_entries(resolved, OWN_FILES, private=False)
    return f"{root}: exists" + (f" (= {resolved})" if str(resolved) != root else "")


def remove_dirs(created: list[Path]) -> None:
    """Remove directories made by `prepare_root`, innermost first, where they are empty."""
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            pass


# ---------------------------------------------------------------------------- its files
def check_entries(root: Path, names, private: bool = True) -> set[str]:
    """Which of `names` exist in `root`; `ConfigError` if one is not a safe regular file. With
    `private`, files that group/others may read are made 0600 (root_dir is private: nobody can
    swap them); without it nothing is changed (`inspect_root`)."""
    present = set()
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        check_file(path, st)
        if private and st.st_mode & 0o077:
            os.chmod(path, 0o600)
        present.add(name)
    return present


def check_file(path: Path, st: os.stat_result, dir_fd: int | None = None) -> None:
    """Refuse a tier file kvtier would open: a symlink, not a regular file, a file with more than
    one name (a hard link: writing it would change the other name's file), or `check_owner`'s."""
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path if dir_fd is None else path.name, dir_fd=dir_fd)
        raise refuse(f"{path} is a symlink (to {target}); kvtier never opens a file in root_dir "
                     f"through a symlink. Remove it ('rm {path}'), or {ADVICE}")
    if not stat.S_ISREG(st.st_mode):
        raise refuse(f"{path} is {file_kind(st.st_mode)}, not a regular file; remove it, or {ADVICE}")
    if st.st_nlink > 1:
        raise refuse(f"{path} has {st.st_nlink} names (hard links), where a file of the tier has one: writing "
                     f"it would change the file of its other name(s); remove it ('rm {path}'), or {ADVICE}")
    check_owner(path, st)


def check_owner(path: Path, st: os.stat_result) -> None:
    """Refuse (`ConfigError` on `root_dir`) a file under a tier's name (`st`: its lstat) that is
    not yours, or (not a symlink) that group/others may write to."""
    if st.st_uid != os.geteuid():
        raise refuse(f"{path} is owned by {owner_name(st.st_uid)} (mode {_mode(st.st_mode)}), not by you "
                     f"({owner_name(os.geteuid())}); remove it, or {ADVICE}")
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise refuse(f"{path} is writable by group or others (mode {_mode(st.st_mode)}); remove it, or {ADVICE}")


def open_existing(path, flags: int, dir_fd: int | None = None) -> int:
    """Open an existing file of the tier, never through a symlink; checked like `check_entries`
    and made 0600 if group/others could read it. With `dir_fd`, `path`'s last name is opened in
    that directory (the whole `path` is what messages show)."""
    name = path if dir_fd is None else Path(path).name
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            check_file(Path(path), os.stat(name, dir_fd=dir_fd, follow_symlinks=False), dir_fd)
        raise
    try:
        st = os.fstat(fd)
        check_file(Path(path), st)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path, flags: int, dir_fd: int | None = None) -> int:
    """Create `path` (0600; with `dir_fd`, its last name in that directory); FileExistsError if
    anything, a dangling symlink included, is there."""
    name = path if dir_fd is None else Path(path).name
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(path, flags: int, dir_fd: int | None = None) -> tuple[int, bool]:
    """`create_new`, or `open_existing` where the file is there (again `create_new` where it was
    removed in between: another process, `kvtier clear`, may unlink it at any time); returns the
    descriptor and whether the file was created here."""
    for _ in range(OPEN_TRIES - 1):
        try:
            return create_new(path, flags, dir_fd), True
        except FileExistsError:
            pass
        try:
            return open_existing(path, flags, dir_fd), False
        except FileNotFoundError:
            continue
    return create_new(path, flags, dir_fd), True  # its error, if it fails yet again


def remove_file(path) -> None:
    """Unlink `path` if present (a symlink itself, never its target)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with a file holding `data` (a crash leaves the old or the new one). The
    temporary file is created afresh (O_EXCL: a leftover, or a symlink planted there, is unlinked
    first, never followed) and removed if writing fails."""
    tmp = path.with_name(path.name + TMP)
    remove_file(tmp)
    fd = create_new(tmp, os.O_WRONLY)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # replaces a symlink at `path` itself, never its target
    except BaseException:
        remove_file(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- wording
def owner_name(uid: int) -> str:
    """"uid 7 (bob)", or "uid 7" where the user has no name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _mode(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def file_kind(mode: int) -> str:
    """What a `st_mode` describes, in words ("a FIFO", "a symbolic link", "a regular file", ...)."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "an unknown kind of file"


def _os_reason(exc: OSError, path: str) -> str:
    if exc.errno == errno.ENAMETOOLONG:
        return f"{path[:80]}...: name too long for this filesystem; use a shorter path"
    return f"{path}: {exc.strerror or exc}"
