"""YAML -> validated, frozen `HierarchyConfig`. The only module that reads raw config dicts.

Every problem found is reported at once (the first 20 listed, the rest counted), each with the
path of its field (`tiers[1].capacity`), what was wrong and what would be valid. Input of any size
or shape is read under the limits of `config_input` (file size, nesting, alias expansion), and
values are quoted in messages by `brief` (at most ~60 characters). Each default lives on its
field, once (`FIELDS` below and the backends' `OPTIONS`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvtier.config.bounded_yaml import load_yaml
from kvtier.config.checks import check_blocks, check_cascade, check_chain_end, check_handlers
from kvtier.config.input import brief, plain, read_config_file, suggest
from kvtier.config.problems import Problems, read_fields
from kvtier.config.shared import SharedHost, parse_shared
from kvtier.core.errors import ConfigError
from kvtier.core.limits import MAX_BLOCK_TOKENS, MAX_BLOCKS, MAX_BYTES
from kvtier.core.types import CASCADE_MODES, DEFAULT_CASCADE, DEFAULT_RESERVE, REQUIRED
from kvtier.core.units import SIZE_UNITS as _UNITS
from kvtier.core.units import format_size as format_size  # re-exported: kvtier.config has always offered it
from kvtier.transfer import registry

_DECIMAL = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "TB": "TiB", "K": "KiB", "M": "MiB", "G": "GiB", "T": "TiB",
            "kB": "KiB", "kiB": "KiB", "Kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB", "kb": "KiB",
            "gib": "GiB", "mib": "MiB", "kib": "KiB", "tib": "TiB"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_BLOCKS_RE = re.compile(r"^\s*(\d+)\s*([km]?)\s*blocks?\s*$", re.IGNORECASE)  # "10000 blocks", "10k blocks"
_FRACTIONAL_BLOCKS_RE = re.compile(r"^\s*\d*\.\d*\s*[km]?\s*blocks?\s*$", re.IGNORECASE)  # "0.5 blocks"
_BLOCK_SCALE = {"": 1, "k": 1000, "m": 1_000_000}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_MAX_BYTES_TEXT = "1048576TiB (1 EiB)"  # MAX_BYTES (the limits: kvtier.core.limits)
DEFAULT_BLOCK_TOKENS = 256  # tokens per offloaded block when the config does not say
_MAX_NUMBER_CHARS = 24  # longer numbers are beyond every limit above; never converted
_MAX_SIZE_CHARS = 64  # a size or capacity string longer than this is refused before any regex reads it


def _check_length(text: str, blocks: bool) -> None:
    """Refuse a size (or, with `blocks`, a capacity) string too long to be one before any regex
    reads it (they would backtrack through it): a number past every limit, or no size at all."""
    if len(text) <= _MAX_SIZE_CHARS:
        return
    stripped = text.strip()
    if stripped[:1].isdigit() and blocks and stripped[-6:].lower().rstrip("s").endswith("block"):
        raise ValueError(f"{brief(text)} is too many; at most {MAX_BLOCKS} blocks")
    if stripped[:1].isdigit():
        raise ValueError(f"{brief(text)} is too large; the largest size is {_MAX_BYTES_TEXT}")
    example = "'64GiB' or '10000 blocks'" if blocks else "'64GiB'"
    raise ValueError(f"{brief(text)} ({len(text)} characters) is too long to be a size; at most "
                     f"{_MAX_SIZE_CHARS} characters: a number and a unit, e.g. {example}")


def parse_size(text: Any) -> int:
    """"64GiB" -> bytes (at most MAX_BYTES). Units: B, KiB, MiB, GiB, TiB. Raises ValueError with a hint."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"expected a size such as '4GiB', got {type(text).__name__} {brief(text)}")
    if isinstance(text, int):
        example = f"{brief(text)}MiB" if text > 0 else "64MiB"  # (never suggest a size that is refused)
        raise ValueError(f"{brief(text)} has no unit; write e.g. '{example}' (units: {', '.join(_UNITS)})")
    _check_length(text, blocks=False)
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{brief(text)} is not a size; write a number and a unit, e.g. '64GiB' "
                         f"(units: {', '.join(_UNITS)})")
    number, unit = match.group(1), match.group(2)
    if len(number) > _MAX_NUMBER_CHARS:
        raise ValueError(f"{brief(text)} is too large; the largest size is {_MAX_BYTES_TEXT}")
    if unit == "":
        raise ValueError(f"{brief(text)} has no unit; write e.g. '{number}MiB' (units: {', '.join(_UNITS)})")
    if unit not in _UNITS:
        hint = _DECIMAL.get(unit)
        better = f"; did you mean '{number}{hint}'? (binary units only)" if hint else ""
        raise ValueError(f"unknown unit {brief(unit)} in {brief(text)}{better} (units: {', '.join(_UNITS)})")
    value = int(Fraction(number) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0, got {brief(text)}")
    if value > MAX_BYTES:
        raise ValueError(f"{brief(text)} is too large; the largest size is {_MAX_BYTES_TEXT}")
    return value


@dataclass(frozen=True)
class Capacity:
    """A tier's capacity: a byte size or a block count (exactly one is set)."""

    bytes: int | None = None
    blocks: int | None = None

    @classmethod
    def parse(cls, value: Any) -> Capacity:
        if isinstance(value, str):
            _check_length(value, blocks=True)
            match = _BLOCKS_RE.match(value)
            if match:
                digits, scale = match.group(1), _BLOCK_SCALE[match.group(2).lower()]
                count = int(digits) * scale if len(digits) <= _MAX_NUMBER_CHARS else MAX_BLOCKS + 1
                if count <= 0:
                    raise ValueError(f"capacity must be at least 1 block, got {brief(value)}")
                if count > MAX_BLOCKS:
                    raise ValueError(f"{brief(value)} is too many; at most {MAX_BLOCKS} blocks")
                return cls(blocks=count)
            if _FRACTIONAL_BLOCKS_RE.match(value):
                raise ValueError(f"a block count is a whole number, got {brief(value)}")
        if isinstance(value, int) and not isinstance(value, bool):
            if value <= 0:
                raise ValueError(f"capacity must be at least 1 block or a size above 0, got {brief(value)}; "
                                 "write e.g. '1000 blocks' or '4GiB'")
            raise ValueError(f"{brief(value)} is ambiguous; write '{brief(value)} blocks' or a size such as "
                             f"'{brief(value)}MiB'")
        return cls(bytes=parse_size(value))

    def to_blocks(self, block_bytes: int | None) -> int:
        """Capacity in blocks, given the size of one block (needed for byte capacities)."""
        if self.blocks is not None:
            return self.blocks
        size = self._size()
        if not block_bytes:
            raise ConfigError(f"capacity {format_size(size)} needs the block size in bytes to be known")
        return size // block_bytes

    def _size(self) -> int:
        """The byte size of a capacity given in bytes."""
        assert self.bytes is not None, "a Capacity has exactly one of blocks and bytes"
        return self.bytes

    def __str__(self) -> str:
        return f"{self.blocks} blocks" if self.blocks is not None else format_size(self._size())


@dataclass(frozen=True)
class TierConfig:
    name: str
    backend: str
    capacity: Capacity
    policy: str | None = None  # None: default_policy(position), filled in by HierarchyConfig
    cascade: str = DEFAULT_CASCADE
    reserve: float = DEFAULT_RESERVE
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class HierarchyConfig:
    tiers: tuple[TierConfig, ...]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    block_bytes: int | None = None
    source: str = "<dict>"
    store_threshold: int = 0  # offers before a block is stored (kvtier.control.store_threshold); <2: off
    shared: SharedHost | None = None  # tiers kept by the host owner (kvtier.config.shared); None: this engine's own

    def __post_init__(self) -> None:
        tiers = tuple(t if t.policy is not None else replace(t, policy=default_policy(i))
                      for i, t in enumerate(self.tiers))
        object.__setattr__(self, "tiers", tiers)

    def with_capacities(self, first_tier_blocks: int) -> HierarchyConfig:
        """A copy whose first tier holds `first_tier_blocks` blocks (capacity sweeps)."""
        first = TierConfig(**{**self.tiers[0].__dict__, "capacity": Capacity(blocks=first_tier_blocks)})
        return replace(self, tiers=(first, *self.tiers[1:]))


# name -> (default or REQUIRED, validator(value) -> normalised value, raising ValueError)
def _positive_int(most: int):
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
            raise ValueError(f"expected a positive integer up to {most}, got {brief(v)}")
        return v
    return check


def _store_threshold(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 20:
        raise ValueError(f"expected 0 (off) or a number of offers up to {1 << 20}, got {brief(v)}")
    return v


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 0.5:
        raise ValueError(f"expected a fraction of the capacity between 0 and 0.5, got {brief(v)}")
    return float(v)


RESERVED_TIER_NAME = "engine"  # `KVTier.stats()["engine"]`: the standalone API's own totals


def _choice(options: tuple[str, ...]):
    def check(v: Any) -> str:
        if not isinstance(v, str) or v not in options:
            raise ValueError(f"{brief(v)} is not one of {', '.join(options)}{suggest(v, options)}")
        return v
    return check


def _name(v: Any) -> str:
    if not isinstance(v, str) or not _NAME_RE.match(v):
        raise ValueError(f"{brief(v)} is not a valid tier name (lowercase letters, digits, '_' or '-', starting with "
                         f"a letter, at most 32 characters)")
    if v == RESERVED_TIER_NAME:
        raise ValueError(f"{v!r} is reserved: KVTier.stats() and its metrics report the API's own totals under it "
                         f"(a tier of that name would be hidden); choose another name, e.g. 'cpu' or 'nvme'")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty string, got {brief(v)}")
    return v


TOP_FIELDS: dict[str, tuple[Any, Any]] = {
    "block_tokens": (DEFAULT_BLOCK_TOKENS, _positive_int(MAX_BLOCK_TOKENS)),
    "block_bytes": (None, parse_size),
    "tiers": (REQUIRED, None),
    "store_threshold": (0, _store_threshold),
    "shared": (None, parse_shared),
}

TIER_FIELDS: dict[str, tuple[Any, Any]] = {
    "name": (REQUIRED, _name),
    "backend": (REQUIRED, _text),
    "capacity": (REQUIRED, Capacity.parse),
    "policy": (None, _text),  # None: default_policy(position of the tier), see HierarchyConfig
    "cascade": (DEFAULT_CASCADE, _choice(CASCADE_MODES)),
    "reserve": (DEFAULT_RESERVE, _fraction),
}


# Replacement policy of a tier whose YAML names none; the evidence is in docs/policies.md
# ("Recommended defaults"): prefix-freq on the tier that receives the engine's stores; plain LRU
# below it, which keeps no ghost keys (prefix-freq remembers 6-12 capacities of evicted keys, up
# to 4-8 million, 0.4-0.8 GB: a lot of RAM to spend on a terabyte file tier for no measured gain).
DEFAULT_POLICY_FIRST_TIER = "prefix-freq"
DEFAULT_POLICY_LOWER_TIERS = "lru"


def default_policy(tier_index: int) -> str:
    """The policy a tier gets when its YAML does not name one."""
    return DEFAULT_POLICY_FIRST_TIER if tier_index == 0 else DEFAULT_POLICY_LOWER_TIERS


def _code_class(kind: registry.Kind, name: str, field: str, problems: Problems, import_code: bool):
    """The class a tier's `backend` or `policy` names, or None.

    kvtier's own registered names are always imported (their classes know the tier's options).
    A "package.module:Class" name is imported only with `import_code` (it runs that module's code);
    without it, the module is only located and None is returned. A problem found is recorded."""
    if name in kind.names or import_code:
        try:
            return registry.load_class(kind, name, field)
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None
    problem = registry.check_name(kind, name)
    if problem:
        problems.add(field, problem)
    return None


def is_external(kind: registry.Kind, name: Any) -> bool:
    """Whether `name` is code outside kvtier's registry ("package.module:Class")."""
    return isinstance(name, str) and name not in kind.names


def parse_config(raw: Any, source: str = "<dict>", *, import_code: bool = True) -> HierarchyConfig:
    """Validate a config mapping; raises `ConfigError` listing every problem (the first 20).

    `raw` is first copied under the limits of `config_input.plain` (size, depth, no cycles).
    With `import_code` (the default; needed before building) a "package.module:Class" named by
    `backend:` or `policy:` is imported and checked to be a class of the right kind; without it
    the module is only located, nothing of it runs, and such a tier's options are not checked.
    """
    problems = Problems()
    raw = plain(raw, source)
    if raw is None:
        raise ConfigError([("", f"{source}: the config is empty; it must be a mapping with a 'tiers' list")])
    if not isinstance(raw, Mapping):
        raise ConfigError([("", f"{source}: the config must be a mapping with a 'tiers' list, "
                                f"got {type(raw).__name__}")])
    top = read_fields(raw, TOP_FIELDS, "", problems, "the hierarchy")
    raw_tiers = raw.get("tiers")
    tiers: list[TierConfig] = []
    if "tiers" in raw and (not isinstance(raw_tiers, list) or not raw_tiers):  # ("tiers:" with no value too)
        problems.add("tiers", f"expected a non-empty list of tiers, got {brief(raw_tiers)}")
        raw_tiers = []
    seen_names: dict[str, int] = {}
    backend_classes: list[Any] = []  # (these two line up with raw_tiers: None, {} where unknown)
    read: list[dict[str, Any]] = []
    for i, raw_tier in enumerate(raw_tiers or []):
        tier, backend_cls, policy_cls, fields = _parse_tier(i, raw_tier, seen_names, problems, import_code)
        backend_classes.append(backend_cls)
        read.append(fields)
        if tier is not None:
            tiers.append(tier)
            check_blocks(i, tier, backend_cls, policy_cls, default_policy(i), top.get("block_bytes"), problems)
            check_cascade(i, tier, policy_cls, default_policy(i), i + 1 < len(raw_tiers or []), problems)
    block_bytes = top.get("block_bytes")
    if block_bytes:
        for i, tier in enumerate(tiers):
            if tier.capacity.bytes is not None and tier.capacity.bytes < block_bytes:
                problems.add(f"tiers[{i}].capacity", f"{tier.capacity} is smaller than one block "
                             f"({format_size(block_bytes)}); give at least {format_size(block_bytes)}")
    check_chain_end(raw_tiers or [], read, backend_classes, problems)
    if tiers and len(tiers) == len(raw_tiers or []):
        check_handlers(tiers, backend_classes, problems)
    if problems.items:
        raise problems.error()
    return HierarchyConfig(tuple(tiers), top["block_tokens"], block_bytes, source, top["store_threshold"],
                           top["shared"])


def _parse_tier(i: int, raw_tier: Any, seen_names: dict[str, int], problems: Problems,
                import_code: bool) -> tuple[TierConfig | None, Any, Any, dict[str, Any]]:
    """`tiers[i]` read into a `TierConfig` (None when a required field is missing or it is not a
    mapping), with the classes its backend and policy name (None where unknown) and its
    `TIER_FIELDS` read (those valid, defaults filled in; {} when not a mapping). Records each
    problem found, and the tier's name in `seen_names`."""
    path = f"tiers[{i}]."
    if not isinstance(raw_tier, Mapping):
        problems.add(f"tiers[{i}]", f"expected a mapping with name, backend, capacity; got {brief(raw_tier)}")
        return None, None, None, {}
    backend_cls = None
    backend_name = raw_tier.get("backend")
    unchecked = False  # an external backend, not imported: its options are unknown
    if isinstance(backend_name, str):
        backend_cls = _code_class(registry.BACKEND, backend_name, f"{path}backend", problems, import_code)
        unchecked = backend_cls is None and not import_code and is_external(registry.BACKEND, backend_name)
    if unchecked:
        options_spec = {k: (None, None) for k in raw_tier if k not in TIER_FIELDS}
    else:
        options_spec = dict(getattr(backend_cls, "OPTIONS", {}))
    what = f"a {brief(backend_name)} tier" if backend_cls else "a tier"
    fields = read_fields({k: v for k, v in raw_tier.items() if k not in options_spec}, TIER_FIELDS, path,
                         problems, what, also_valid=options_spec)
    options = read_fields({k: v for k, v in raw_tier.items() if k in options_spec}, options_spec, path,
                          problems, what)
    check_options = getattr(backend_cls, "check_options", None)
    if check_options is not None:
        problems.extend([(f"{path}{option}", message) for option, message in check_options(options)])
    name = fields.get("name")
    if name in seen_names:
        problems.add(f"{path}name",
                     f"duplicate tier name {name!r} (also tiers[{seen_names[name]}]); names must be unique")
    elif isinstance(name, str):
        seen_names[name] = i
    policy = fields.get("policy")  # None: the default of the tier's position (HierarchyConfig)
    policy_cls = None
    if isinstance(policy, str):
        policy_cls = _code_class(registry.POLICY, policy, f"{path}policy", problems, import_code)
    elif policy is None:
        policy_cls = registry.load_class(registry.POLICY, default_policy(i), f"{path}policy")
    tier = None
    if all(k in fields for k in ("name", "backend", "capacity")):
        tier = TierConfig(options=MappingProxyType(options), **fields)
    return tier, backend_cls, policy_cls, fields


def load_config(path: str | Path, *, import_code: bool = True) -> HierarchyConfig:
    """Read and validate a YAML file (UTF-8, at most MAX_CONFIG_BYTES; see `config_input`)."""
    return load_config_text(read_config_file(path), str(path), import_code=import_code)


def load_config_text(text: str, source: str = "<string>", *, import_code: bool = True) -> HierarchyConfig:
    """Parse and validate YAML text; nesting, size and alias expansion are bounded (`config_input`).
    `ConfigError` lists every problem, with `source` set."""
    try:
        return parse_config(load_yaml(text, source), source, import_code=import_code)
    except ConfigError as exc:
        exc.source = source
        raise


def load_raw_config_file(path: str | Path) -> Any:
    """The YAML value of a config file, read under the limits of `config_input`, not validated."""
    return load_yaml(read_config_file(path), str(path))


def default_config_path() -> Path:
    """The embedded default hierarchy (`configs/cpu-file.yaml`, shipped inside the package)."""
    return Path(__file__).parent.parent / "configs" / "cpu-file.yaml"
