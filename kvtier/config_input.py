"""Reading config input of any shape without letting it cost more than a config is worth.

A hierarchy config is a few hundred bytes: a handful of tiers, a few dozen values. Whatever is
handed to kvtier (a file, a string, a mapping built by vLLM from its own command line) is read
under limits far above that, so that a mistaken or hostile input gets one `ConfigError` naming
the field, in well under a second, instead of a traceback, a hang or a flood of output:

* a file is at most `MAX_CONFIG_BYTES` (its size is checked before it is read, and no more than
  the limit plus one byte is ever read); it must be UTF-8 (a UTF-16 or binary file is refused);
* YAML is composed with nesting at most `MAX_DEPTH` deep and at most `MAX_VALUES` values, where a
  value reached through an alias (`*name`, merge keys `<<`) counts each time it is reached: an
  "alias bomb" that would expand to millions of values is refused before it is built, while a
  config that shares a mapping between tiers through an anchor still loads;
* integers written with more than `MAX_INT_DIGITS` digits are refused where they are read;
* `plain` copies an already-built mapping (vLLM's inline config) under the same limits, refusing
  cycles;
* `brief` quotes a value in a message: at most about `BRIEF_CHARS` characters, whatever its size.

Every error names the path of the offending field (`tiers[0].capacity`), or the file for problems
of the file as a whole (size, encoding, YAML syntax).
"""

from __future__ import annotations

import codecs
import difflib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.quoting import BRIEF_CHARS as BRIEF_CHARS  # re-exported, as brief
from kvtier.quoting import brief as brief

MAX_CONFIG_BYTES = 1 << 20  # 1 MiB: a real config is under 4 KiB
MAX_DEPTH = 32  # a real config nests 4 deep (mapping, tiers list, tier mapping, an option's list)
MAX_VALUES = 10_000  # values (scalars, lists, mappings), counting each time an alias is reached
MAX_INT_DIGITS = 64  # far above any size or count; int() of thousands of digits is slow or refused

def clip(text: str, limit: int = 200) -> str:
    """`text` cut to at most `limit` characters (for messages quoting other messages or paths)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def suggest(value: Any, options) -> str:
    """" (did you mean 'x'?)" for the option closest to a short string `value`, else ""."""
    if not isinstance(value, str) or len(value) > 64:
        return ""
    close = difflib.get_close_matches(value, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
            raise ConfigError([("", _too_large(name, f"{info.st_size} bytes"))])
        if stat.S_ISFIFO(info.st_mode):
            os.set_blocking(fd, True)  # wait for a writer's bytes (e.g. `<(cat x.yaml)`)
        data = _read_at_most(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([("", f"cannot read config {name}: {exc.strerror or exc}")]) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([("", _too_large(name, "more bytes than that"))])
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


def _too_large(source: Any, size: str) -> str:
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


# ------------------------------------------------------------------------------------------- YAML
class _Refused(Exception):
    """Raised while composing: the input breaks a limit at `segments`."""

    def __init__(self, segments: list[Any], message: str):
        super().__init__(message)
        self.segments = segments
        self.message = message


def _loader_class(libyaml: bool):
    """A safe YAML loader (libyaml's parser if asked and available) whose composer enforces the limits."""
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.events import AliasEvent
    from yaml.nodes import ScalarNode
    from yaml.resolver import Resolver

    try:
        if not libyaml:
            raise ImportError("the pure-Python parser was asked for")
        from yaml.cyaml import CParser as Parser

        def init_parser(self, text):
            Parser.__init__(self, text)
    except ImportError:  # no libyaml: the pure-Python reader, scanner and parser (slower, same limits)
        from yaml.parser import Parser as _PyParser
        from yaml.reader import Reader
        from yaml.scanner import Scanner

        class Parser(Reader, Scanner, _PyParser):  # type: ignore[no-redef]
            pass

        def init_parser(self, text):
            Reader.__init__(self, text)
            Scanner.__init__(self)
            _PyParser.__init__(self)

    int_tag = "tag:yaml.org,2002:int"

    class BoundedLoader(Composer, Parser, SafeConstructor, Resolver):
        """Composes at most MAX_VALUES nodes (aliases included), at most MAX_DEPTH deep; refuses
        integers of more than MAX_INT_DIGITS digits. Tracks the path of the node being composed."""

        def __init__(self, text: str):
            init_parser(self, text)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
            self.path: list[Any] = []
            self.count = 0
            self.aliases = 0  # without any, nothing expands: the expansion check is skipped

        def compose_node(self, parent, index):
            self.count += 1
            if self.count > MAX_VALUES:
                raise _Refused(list(self.path), f"more than {MAX_VALUES} values (the limit; a hierarchy config "
                                                f"has a few dozen)")
            if self.check_event(AliasEvent):
                self.aliases += 1
            if parent is not None:  # the root has no path segment
                self.path.append(index if isinstance(index, int)
                                 else index.value if isinstance(index, ScalarNode) else "?")
            try:
                if len(self.path) > MAX_DEPTH:
                    raise _Refused(self.path[:-1], f"nested more than {MAX_DEPTH} deep (the limit)")
                node = super().compose_node(parent, index)
                if isinstance(node, ScalarNode) and node.tag == int_tag and len(node.value) > MAX_INT_DIGITS:
                    raise _Refused(list(self.path), f"an integer of {len(node.value)} characters is far too large "
                                                    f"(at most {MAX_INT_DIGITS} digits are read)")
                return node
            finally:
                if parent is not None:
                    self.path.pop()

    return BoundedLoader


_LOADERS: dict[bool, type] = {}


LIBYAML_DEPTH_LIMIT = "exceeded maximum nesting depth"  # libyaml's own refusal of deep flow nesting


def load_yaml(text: str, source: str, *, libyaml: bool = True) -> Any:
    """Parse one YAML document of config text under the limits above; raises `ConfigError`.

    libyaml's parser is used when installed (a 1 MiB file parses in milliseconds); `libyaml=False`
    forces PyYAML's pure-Python one, which applies the same limits, slower."""
    import yaml

    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([("", _too_large(source, f"{len(text)} characters"))])
    if libyaml not in _LOADERS:
        _LOADERS[libyaml] = _loader_class(libyaml)
    loader = None
    try:
        loader = _LOADERS[libyaml](text)
        node = loader.get_single_node()
        if node is None:
            return None
        problems = _expansion_problems(node) if loader.aliases else []
        if problems:
            raise ConfigError(problems)
        return loader.construct_document(node)
    except ConfigError:
        raise
    except _Refused as exc:
        path = field_path(exc.segments)
        raise ConfigError([(path, exc.message if path else f"{source}: {exc.message}")]) from None
    except yaml.YAMLError as exc:
        if libyaml and LIBYAML_DEPTH_LIMIT in str(exc):
            # libyaml >= 0.2.5 (bundled with PyYAML 6.0.4) stops at its own nesting limit while
            # scanning ahead, before our composer sees depth 33 and can name the field: the
            # pure-Python parser reaches the composer's check with the path.
            return load_yaml(text, source, libyaml=False)
        raise ConfigError([("", f"{source}: invalid YAML{_where(exc)}: {_yaml_problem(exc)}")]) from None
    except (ValueError, TypeError, RecursionError) as exc:  # a constructor refusing a scalar, text not encodable
        raise ConfigError([("", f"{source}: cannot read the YAML: {clip(str(exc))}")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _where(exc: Any) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f" at line {mark.line + 1}, column {mark.column + 1}"
    position = getattr(exc, "position", None)
    return f" at character {position}" if isinstance(position, int) else ""


def _yaml_problem(exc: Any) -> str:
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
    context = getattr(exc, "context", None)
    return clip(f"{context}; {problem}" if context else str(problem))


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(path segment, child node) of a YAML node; a mapping's keys are children too."""
    from yaml.nodes import MappingNode, ScalarNode, SequenceNode

    if isinstance(node, SequenceNode):
        return list(enumerate(node.value))
    if isinstance(node, MappingNode):
        out = []
        for key, value in node.value:
            out.append(("?", key))
            out.append((key.value if isinstance(key, ScalarNode) else "?", value))
        return out
    return []


def _expansion_problems(root: Any) -> list[tuple[str, str]]:
    """Fields whose value, with every alias expanded, holds more than MAX_VALUES values.

    Sizes are computed once per node (sharing is what makes a bomb small on disk), saturating at
    MAX_VALUES + 1; an alias back to an enclosing node (a cycle) counts once here and is refused,
    with its path, when the built value is copied by `plain`.
    """
    sizes = _expanded_sizes(root)
    if sizes[id(root)] <= MAX_VALUES:
        return []
    paths: list[list[Any]] = []
    _blame(root, [], sizes, set(), paths)
    return [(field_path(p), f"expands to more than {MAX_VALUES} values through YAML aliases (the limit; an "
                            f"alias counts each time it is used)") for p in paths]


def _blame(node: Any, segments: list[Any], sizes: dict[int, int], visited: set[int], out: list[list[Any]]) -> None:
    """Append to `out` the paths of the too-large values inside `node` (itself too large): the
    deepest such value, and every mapping key where an already-reported value is used again."""
    from yaml.nodes import MappingNode

    visited.add(id(node))
    handled = False
    if len(segments) < MAX_DEPTH:
        for seg, child in _children(node):
            if len(out) >= 20:
                return
            if sizes.get(id(child), 0) <= MAX_VALUES:
                continue
            if id(child) not in visited:
                _blame(child, segments + [seg], sizes, visited, out)
                handled = True
            elif isinstance(node, MappingNode):
                out.append(segments + [seg])
                handled = True
    if not handled and len(out) < 20:
        out.append(segments)


def _expanded_sizes(root: Any) -> dict[int, int]:
    """id(node) -> values under it with aliases expanded (saturating at MAX_VALUES + 1), iteratively."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            total = 1 + sum(sizes.get(id(child), 1) for _, child in _children(node))
            sizes[key] = min(total, MAX_VALUES + 1)
            continue
        if key in sizes or key in open_nodes:
            continue  # done already, or a cycle (counted as 1 here)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for _, child in _children(node))
    return sizes


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
