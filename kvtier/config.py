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

from kvtier import registry
from kvtier.config_input import brief, clip, plain, read_config_file, suggest
from kvtier.config_yaml import load_yaml
from kvtier.errors import ConfigError
from kvtier.limits import MAX_BLOCK_TOKENS, MAX_BLOCKS, MAX_BYTES, tier_blocks_problem
from kvtier.types import CASCADE_MODES, DEFAULT_CASCADE, DEFAULT_RESERVE, REQUIRED
from kvtier.units import SIZE_UNITS as _UNITS
from kvtier.units import format_size as format_size  # re-exported: kvtier.config has always offered it

_DECIMAL = {"KB": "KiB", "MB": "MiB", "GB": "GiB", "TB": "TiB", "K": "KiB", "M": "MiB", "G": "GiB", "T": "TiB",
            "kB": "KiB", "kiB": "KiB", "Kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB", "kb": "KiB",
            "gib": "GiB", "mib": "MiB", "kib": "KiB", "tib": "TiB"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_BLOCKS_RE = re.compile(r"^\s*(\d+)\s*([km]?)\s*blocks?\s*$", re.IGNORECASE)  # "10000 blocks", "10k blocks"
_BLOCK_SCALE = {"": 1, "k": 1000, "m": 1_000_000}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_MAX_BYTES_TEXT = "1048576TiB (1 EiB)"  # MAX_BYTES (the limits: kvtier.limits)
DEFAULT_BLOCK_TOKENS = 256  # tokens per offloaded block when the config does not say
_MAX_NUMBER_CHARS = 24  # longer numbers are beyond every limit above; never converted


def parse_size(text: Any) -> int:
    """"64GiB" -> bytes (at most MAX_BYTES). Units: B, KiB, MiB, GiB, TiB. Raises ValueError with a hint."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"expected a size such as '4GiB', got {type(text).__name__} {brief(text)}")
    if isinstance(text, int):
        raise ValueError(f"{brief(text)} has no unit; write e.g. '{brief(text)}MiB' (units: {', '.join(_UNITS)})")
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
            match = _BLOCKS_RE.match(value)
            if match:
                digits, scale = match.group(1), _BLOCK_SCALE[match.group(2).lower()]
                count = int(digits) * scale if len(digits) <= _MAX_NUMBER_CHARS else MAX_BLOCKS + 1
                if count <= 0:
                    raise ValueError(f"capacity must be at least 1 block, got {brief(value)}")
                if count > MAX_BLOCKS:
                    raise ValueError(f"{brief(value)} is too many; at most {MAX_BLOCKS} blocks")
                return cls(blocks=count)
        if isinstance(value, int) and not isinstance(value, bool):
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
    store_threshold: int = 0  # offers before a block is stored (kvtier.store_threshold); <2: off

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


def _key(key: Any) -> str:
    """A mapping key as it appears in a field path: plain names as they are, anything else quoted briefly."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 40 else brief(key, 40)


NOT_SHOWN = " more problem(s) not shown"


class _Problems:
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


def _read_fields(raw: Mapping[str, Any], fields: Mapping[str, tuple[Any, Any]], path: str, problems: _Problems,
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
        problems.add(f"{path}{_key(key)}", f"unknown key for {what}{suggest(key, valid)}",
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


def _code_class(kind: registry.Kind, name: str, field: str, problems: _Problems, import_code: bool):
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
    problems = _Problems()
    raw = plain(raw, source)
    if raw is None:
        raise ConfigError([("", f"{source}: the config is empty; it must be a mapping with a 'tiers' list")])
    if not isinstance(raw, Mapping):
        raise ConfigError([("", f"{source}: the config must be a mapping with a 'tiers' list, "
                                f"got {type(raw).__name__}")])
    top = _read_fields(raw, TOP_FIELDS, "", problems, "the hierarchy")
    raw_tiers = raw.get("tiers")
    tiers: list[TierConfig] = []
    if raw_tiers is not None and (not isinstance(raw_tiers, list) or not raw_tiers):
        problems.add("tiers", f"expected a non-empty list of tiers, got {brief(raw_tiers)}")
        raw_tiers = []
    seen_names: dict[str, int] = {}
    backend_classes = []
    for i, raw_tier in enumerate(raw_tiers or []):
        path = f"tiers[{i}]."
        if not isinstance(raw_tier, Mapping):
            problems.add(f"tiers[{i}]", f"expected a mapping with name, backend, capacity; got {brief(raw_tier)}")
            continue
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
        fields = _read_fields({k: v for k, v in raw_tier.items() if k not in options_spec}, TIER_FIELDS, path,
                              problems, what, also_valid=options_spec)
        options = _read_fields({k: v for k, v in raw_tier.items() if k in options_spec}, options_spec, path,
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
        backend_classes.append(backend_cls)
        if all(k in fields for k in ("name", "backend", "capacity")):
            tiers.append(TierConfig(options=MappingProxyType(options), **fields))
            _check_blocks(i, tiers[-1], backend_cls, policy_cls, top.get("block_bytes"), problems)
    block_bytes = top.get("block_bytes")
    if block_bytes:
        for i, tier in enumerate(tiers):
            if tier.capacity.bytes is not None and tier.capacity.bytes < block_bytes:
                problems.add(f"tiers[{i}].capacity", f"{tier.capacity} is smaller than one block "
                             f"({format_size(block_bytes)}); give at least {format_size(block_bytes)}")
    if tiers and len(tiers) == len(raw_tiers or []):
        _check_handlers(tiers, backend_classes, problems)
    if problems.items:
        raise problems.error()
    return HierarchyConfig(tuple(tiers), top["block_tokens"], block_bytes, source, top["store_threshold"])


def _check_blocks(i: int, tier: TierConfig, backend_cls, policy_cls, block_bytes: int | None,
                  problems: _Problems) -> None:
    """tiers[i]'s block count against what its backend and policy can hold (`kvtier.limits`, as
    the build checks it); a capacity in bytes is counted only when the config gives block_bytes."""
    blocks = tier.capacity.blocks
    if blocks is None and block_bytes and tier.capacity.bytes is not None:
        blocks = tier.capacity.bytes // block_bytes
    if not blocks:  # unknown, or a size smaller than a block (reported below)
        return
    policy = tier.policy or default_policy(i)
    problem = tier_blocks_problem(blocks, backend_cls, policy_cls, backend_name=tier.backend, policy_name=policy)
    if problem:
        problems.add(f"tiers[{i}].capacity", problem)


def _check_handlers(tiers: list[TierConfig], classes: list, problems: _Problems) -> None:
    """Every hop the hierarchy will use must have a registered handler."""
    if any(c is None for c in classes):
        return
    specs = [c.spec_type.__name__ for c in classes]
    _check_shared(tiers, classes, problems)
    for i in range(len(tiers) - 1):
        upper, lower = specs[i], specs[i + 1]
        shared_below = getattr(classes[i + 1], "shared", False)  # fed by publishing, not by the cascade
        if tiers[i].cascade != "none" and not shared_below and not registry.has_handler(upper, lower):
            problems.add(f"tiers[{i}].cascade", f"no handler moves blocks from {tiers[i].backend!r} ({upper}) to "
                         f"{tiers[i + 1].backend!r} ({lower}); set cascade: none or change the backends")
        if not (registry.has_handler(lower, specs[0]) or registry.has_handler(lower, "GPULoadStoreSpec")):
            problems.add(f"tiers[{i + 1}].backend", f"blocks in {tiers[i + 1].backend!r} could never be loaded: no "
                         f"handler from {lower} to {specs[0]} or to the engine's KV cache")


def _check_shared(tiers: list[TierConfig], classes: list, problems: _Problems) -> None:
    """A shared tier (`Backend.shared`, e.g. valkey) comes after every local tier, at most one of
    them, and the first tier is then a host-memory (CPU) tier: it publishes from there and
    promotes into there."""
    shared = [i for i, c in enumerate(classes) if getattr(c, "shared", False)]
    if not shared:
        return
    for i in shared[1:]:
        problems.add(f"tiers[{i}].backend", f"a second shared tier ({tiers[shared[0]].name!r} is one); a "
                     f"hierarchy has at most one")
    local = [i for i, c in enumerate(classes) if not getattr(c, "shared", False)]
    if not local:
        problems.add(f"tiers[{shared[0]}].backend", f"{tiers[shared[0]].backend!r} is a shared tier; it needs a "
                     f"host-memory first tier (backend: cpu or memory) before it")
        return
    if local[-1] > shared[0]:
        problems.add(f"tiers[{shared[0]}].backend", f"shared tier {tiers[shared[0]].name!r} must come after every "
                     f"local tier (tiers[{local[-1]}] {tiers[local[-1]].name!r} is after it); move it last")
    if classes[0].medium != "CPU":
        problems.add("tiers[0].backend", f"with a shared tier ({tiers[shared[0]].name!r}) the first tier must be a "
                     f"host-memory tier (backend: cpu or memory), got {tiers[0].backend!r}")


def load_config(path: str | Path, *, import_code: bool = True) -> HierarchyConfig:
    """Read and validate a YAML file (UTF-8, at most MAX_CONFIG_BYTES; see `config_input`)."""
    return load_config_text(read_config_file(path), str(path), import_code=import_code)


def load_config_text(text: str, source: str = "<string>", *, import_code: bool = True) -> HierarchyConfig:
    """Parse and validate YAML text; nesting, size and alias expansion are bounded (`config_input`)."""
    return parse_config(load_yaml(text, source), source, import_code=import_code)


def load_raw_config_file(path: str | Path) -> Any:
    """The YAML value of a config file, read under the limits of `config_input`, not validated."""
    return load_yaml(read_config_file(path), str(path))


def default_config_path() -> Path:
    """The embedded default hierarchy (`configs/cpu-file.yaml`, shipped inside the package)."""
    return Path(__file__).with_name("configs") / "cpu-file.yaml"
