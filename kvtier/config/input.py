"""Reading config input of any shape without letting it cost more than a config is worth.

A hierarchy config is a few hundred bytes: a handful of tiers, a few dozen values. Whatever is
handed to kvtier (a file, a string, a mapping built by vLLM from its own command line) is read
under limits far above that, so that a mistaken or hostile input gets one `ConfigError` naming
the field, in well under a second, instead of a traceback, a hang or a flood of output:

* a file is at most `MAX_CONFIG_BYTES` (its size is checked before it is read, and no more than
  the limit plus one byte is ever read); it must be UTF-8 (a UTF-16 or binary file is refused);
* YAML (`kvtier.config.bounded_yaml.load_yaml`) is composed with nesting at most `MAX_DEPTH` deep and
  at most `MAX_VALUES` values, where a value reached through an alias (`*name`, merge keys
  `<<`) counts each time it is reached: an "alias bomb" that would expand to millions of values
  is refused before it is built, while a config that shares a mapping between tiers through an
  anchor still loads;
* integers written with more than `MAX_INT_DIGITS` digits are refused where they are read;
* `plain` copies an already-built mapping (vLLM's inline config) under the same limits, refusing
  cycles;
* `brief` quotes a value in a message: at most about `BRIEF_CHARS` characters, whatever its size.

Every error names the path of the offending field (`tiers[0].capacity`), or the file for problems
of the file as a whole (size, encoding, YAML syntax).
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.quoting import BRIEF_CHARS as BRIEF_CHARS  # re-exported, as brief
from kvtier.core.quoting import brief as brief
from kvtier.core.quoting import clip as clip  # re-exported
from kvtier.core.quoting import suggest as suggest  # re-exported

MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: a real config is under 4 KiB
MAX_DEPTH = 32  # a real config nests 4 deep (mapping, tiers list, tier mapping, an option's list)
MAX_VALUES = 10_000  # values (scalars, lists, mappings), counting each time an alias is reached
MAX_INT_DIGITS = 64  # far above any size or count; int() of thousands of digits is slow or refused

def field_path(segments: list[Any]) -> str:
    """["tiers", 0, "capacity"] -> "tiers[0].capacity" (keys quoted briefly when not plain names;
    a path more than 8 levels deep is shown by its first 6 and "…")."""
    out = ""
    for n, seg in enumerate(segments):
        if n == 6 and len(segments) > 8:
            return out + "…"
        if isinstance(seg, int) and not isinstance(seg, bool):
            out += f"[{seg}]"
            continue
        text = seg if isinstance(seg, str) and seg.isprintable() and len(seg) <= 40 else brief(seg, 40)
        out += f".{text}" if out else text
    return out


# ------------------------------------------------------------------------------------------ files
def read_config_file(path: str | Path) -> str:
    """The text of a config file: at most `MAX_CONFIG_BYTES`, UTF-8 (a leading BOM is allowed).

    The size of a regular file is checked before reading it; a pipe or device is read up to the
    limit plus one byte. A FIFO without a writer reads as empty (it is opened non-blocking).
    """
    name = clip(str(path), 300)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError([("", f"cannot read config {name}: {getattr(exc, 'strerror', None) or exc}")]) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError([("", f"cannot read config {name}: it is a directory; give a YAML file")])
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError([("", too_large(name, f"{info.st_size} bytes"))])
        if stat.S_ISFIFO(info.st_mode):
            os.set_blocking(fd, True)  # wait for a writer's bytes (e.g. `<(cat x.yaml)`)
        data = _read_at_most(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([("", f"cannot read config {name}: {exc.strerror or exc}")]) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([("", too_large(name, "more bytes than that"))])
    return decode_config(data, name)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def too_large(source: Any, size: str) -> str:
    return (f"{source}: config is {size}; the limit is {MAX_CONFIG_BYTES >> 20} MiB "
            f"(a hierarchy config is a few hundred bytes: is this the right file?)")


_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def decode_config(data: bytes, source: str) -> str:
    """UTF-8 bytes -> text; any other encoding or binary data is refused with the reason."""
    for bom, name in _WIDE_BOMS:
        if data.startswith(bom):
            raise ConfigError([("", f"{source}: the file is {name} text; save it as UTF-8")])
    if b"\0" in data[:4096]:
        raise ConfigError([("", f"{source}: the file holds NUL bytes (binary data, or UTF-16 text without a "
                                f"byte-order mark); a config is UTF-8 text")])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([("", f"{source}: not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} "
                                f"(offset {exc.start}); save the file as UTF-8")]) from None


# --------------------------------------------------------------------------------- built mappings
def plain(value: Any, source: str = "the config") -> Any:
    """A copy of a config value with every mapping a `dict` and every list or tuple a `list`.

    Refuses (ConfigError naming the path) a value that contains itself, nests deeper than
    MAX_DEPTH or holds more than MAX_VALUES values counting shared ones each time they are reached.
    """
    try:
        return _plain(value, [], set(), [MAX_VALUES])
    except ConfigError as exc:
        raise ConfigError([(p, m if p else f"{source}: {m}") for p, m in exc.problems]) from None


def _plain(value: Any, segments: list[Any], open_ids: set[int], budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError([(field_path(segments[:-1]), f"more than {MAX_VALUES} values (the limit; shared values "
                                                       f"count each time they are reached)")])
    is_map = isinstance(value, Mapping)
    if not is_map and not isinstance(value, (list, tuple)):
        return value
    if len(segments) >= MAX_DEPTH:
        raise ConfigError([(field_path(segments), f"nested more than {MAX_DEPTH} deep (the limit)")])
    if id(value) in open_ids:
        raise ConfigError([(field_path(segments), "contains itself (a recursive alias or a cyclic mapping)")])
    open_ids.add(id(value))
    try:
        if is_map:
            return {k: _plain(v, segments + [k], open_ids, budget) for k, v in value.items()}
        return [_plain(v, segments + [i], open_ids, budget) for i, v in enumerate(value)]
    finally:
        open_ids.discard(id(value))
