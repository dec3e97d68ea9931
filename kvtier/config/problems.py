"""Collecting a config's problems: every one found is reported at once, the first `Problems.MAX`
listed with the path of its field, the rest counted (`count_problems`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.quoting import brief, clip, suggest
from kvtier.core.types import REQUIRED


def field_key(key: Any) -> str:
    """A mapping key as it appears in a field path: plain names as they are, anything else quoted briefly."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 40 else brief(key, 40)


NOT_SHOWN = " more problem(s) not shown"


class Problems:
    """Problems found so far; only the first MAX of them are kept (the rest are counted)."""

    MAX = 20

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.dropped = 0

    @property
    def full(self) -> bool:
        return len(self.items) >= self.MAX

    def add(self, path: str, message: str, tail: str = "") -> None:
        """`tail` (text from the code, e.g. a list of valid keys) is kept whole; `message` is clipped."""
        if self.full:
            self.dropped += 1
        else:
            self.items.append((path, clip(message, 300) + tail))

    def extend(self, problems: list[tuple[str, str]]) -> None:
        for path, message in problems:
            self.add(path, message)

    def error(self) -> ConfigError:
        more = [("", f"{self.dropped}{NOT_SHOWN}")] if self.dropped else []
        return ConfigError(self.items + more)


def count_problems(error: ConfigError) -> int:
    """How many problems `error` stands for, counting those not listed."""
    *listed, (_, last) = error.problems or [("", "")]
    if last.endswith(NOT_SHOWN) and last[: -len(NOT_SHOWN)].isdigit():
        return len(listed) + int(last[: -len(NOT_SHOWN)])
    return len(error.problems)


def read_fields(raw: Mapping[str, Any], fields: Mapping[str, tuple[Any, Any]], path: str, problems: Problems,
                 what: str, also_valid: Mapping[str, Any] = MappingProxyType({})) -> dict[str, Any]:
    """Check and normalise `fields` of `raw`; keys in neither `fields` nor `also_valid` are reported."""
    valid = [*fields, *also_valid]
    out: dict[str, Any] = {}
    for key in raw:
        if key in valid:
            continue
        if problems.full:  # no suggestion computed for problems that are not shown
            problems.dropped += 1
            continue
        problems.add(f"{path}{field_key(key)}", f"unknown key for {what}{suggest(key, valid)}",
                     f"; valid keys: {', '.join(valid)}")
    for key, (default, check) in fields.items():
        if key not in raw or (raw[key] is None and default is not REQUIRED):
            if default is REQUIRED:
                problems.add(f"{path}{key}", f"missing (required for {what})")
            else:
                out[key] = default
            continue
        try:
            out[key] = check(raw[key]) if check else raw[key]
        except (ValueError, TypeError, OverflowError) as exc:
            problems.add(f"{path}{key}", str(exc))
    return out
