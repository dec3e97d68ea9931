"""YAML config text -> plain Python values, under `kvtier.config.input`'s limits (`MAX_DEPTH`,
`MAX_VALUES` counting every alias expansion, `MAX_INT_DIGITS`): one `ConfigError` naming the
field, never a hang or a traceback."""

from __future__ import annotations

from typing import Any

from kvtier.config.input import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    MAX_VALUES,
    clip,
    field_path,
    too_large,
)
from kvtier.core.errors import ConfigError


# ------------------------------------------------------------------------------------------- YAML
class _Refused(Exception):
    """Raised while composing: the input breaks a limit at `segments`."""

    def __init__(self, segments: list[Any], message: str):
        super().__init__(message)
        self.segments = segments
        self.message = message


def _parser(libyaml: bool) -> tuple[Any, Any]:
    """The YAML parser class to mix into the loader (libyaml's if asked and available, else
    PyYAML's pure-Python reader, scanner and parser: slower, same limits) and its initialiser."""
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
    return Parser, init_parser


def _loader_class(libyaml: bool):
    """A safe YAML loader (libyaml's parser if asked and available) whose composer enforces the limits."""
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.events import AliasEvent
    from yaml.nodes import ScalarNode
    from yaml.resolver import Resolver

    Parser, init_parser = _parser(libyaml)
    int_tag = "tag:yaml.org,2002:int"

    class BoundedLoader(Composer, Parser, SafeConstructor, Resolver):  # type: ignore[valid-type,misc]
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
        raise ConfigError([("", too_large(source, f"{len(text)} characters"))])
    if libyaml not in _LOADERS:
        _LOADERS[libyaml] = _loader_class(libyaml)
    loader = None
    try:
        loader = _LOADERS[libyaml](text)
        node = loader.get_single_node()
        if node is None:
            return None
        problems = _expansion_problems(node) if loader.aliases else []
        problems += _repeated_keys(node)
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


def _repeated_keys(root: Any) -> list[tuple[str, str]]:
    """A problem per key written twice in one mapping (YAML would keep the last silently: a
    typo'd copy of `capacity` would override the first). Each node is visited once, aliases too;
    a merge key (`<<`) may repeat keys, as YAML means it to."""
    from yaml.nodes import MappingNode, ScalarNode

    problems: list[tuple[int, list[Any], str]] = []
    visited: set[int] = set()
    stack: list[tuple[Any, list[Any]]] = [(root, [])]
    while stack:
        node, segments = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, MappingNode):
            lines: dict[str, int] = {}
            for key, _ in node.value:
                if not isinstance(key, ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    continue
                line = key.start_mark.line + 1
                if key.value in lines:
                    problems.append((line, segments + [key.value], f"given twice (lines {lines[key.value]} and "
                                                                   f"{line}); keep one (YAML would use the last)"))
                else:
                    lines[key.value] = line
        stack.extend((child, segments + [segment]) for segment, child in _children(node) if segment != "?")
    return [(field_path(segments), message) for _, segments, message in sorted(problems, key=lambda p: p[0])]


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
