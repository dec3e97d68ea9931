"""A kvtier config under vLLM: where it comes from (`kvtier_config`); what vLLM decides in it and
requires of it is `kvtier.config.vllm` (vLLM-free, shared with `kvtier config check --vllm`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import HierarchyConfig, default_config_path
from kvtier.config.input import plain
from kvtier.config.problems import NOT_SHOWN, count_problems
from kvtier.config.vllm import is_persistent, require_cpu_first, vllm_hierarchy_config
from kvtier.core.errors import ConfigError

__all__ = ["INLINE_SOURCE", "is_persistent", "load_raw_config", "load_vllm_config", "vllm_hierarchy_config"]

INLINE_SOURCE = "kv_connector_extra_config.kvtier_config"  # the source of an inline mapping


def load_raw_config(value: Any) -> tuple[dict[str, Any], str]:
    """`kvtier_config` (a YAML path, an inline mapping, or None for kvtier's default) -> (dict, source).

    A file is read and an inline mapping copied under the limits of `kvtier.config.input` (size,
    nesting, values counted through aliases or shared objects, no cycles): a `ConfigError` naming
    the field, never a hang, whatever the keys it sits under. A relative path is read from the
    process's working directory (the source is the absolute path); when it is not there the
    problem names that directory, and the copy kvtier ships of a config of that name if any. The
    default config comes without its `block_tokens`: vLLM decides it, and the user wrote no file."""
    from kvtier.config import load_raw_config_file

    if value is None:
        path = default_config_path()
        raw = _sourced(load_raw_config_file, path, str(path))
        if isinstance(raw, dict):
            raw.pop("block_tokens", None)
        return raw, str(path)
    if isinstance(value, Mapping):
        return _sourced(plain, value, INLINE_SOURCE), INLINE_SOURCE
    if isinstance(value, (str, Path)):
        if not str(value).strip():
            raise ConfigError([("kvtier_config", "is empty: give a YAML path or a mapping, or leave kvtier_config out "
                                                 f"for kvtier's default ({default_config_path()})")])
        path = Path(os.path.abspath(Path(value).expanduser()))
        try:
            return load_raw_config_file(path), str(path)
        except ConfigError as exc:  # problems of the file as a whole are problems of `kvtier_config`
            hint = _not_found(Path(value), path)
            error = ConfigError([(p or "kvtier_config", m + (hint if not p else "")) for p, m in exc.problems])
            error.source = str(path)
            raise error from None
    raise TypeError(f"kvtier_config must be a path or a mapping, got {type(value).__name__}")


def _sourced(read: Any, value: Any, source: str) -> Any:
    """`read(value)`; a `ConfigError` it raises gets `source`."""
    try:
        return read(value)
    except ConfigError as exc:
        exc.source = source
        raise


def _not_found(given: Path, path: Path) -> str:
    """What to add to a read error of `path` (the absolute form of `given`): "" when it exists;
    else the directory a relative path was looked for in, and kvtier's packaged config of that
    name, if there is one."""
    try:
        if path.exists() or path.is_symlink():
            return ""
        packaged = default_config_path().parent / path.name
        shipped = packaged.is_file()
    except (OSError, ValueError):  # (a NUL in the path: the read error says so)
        return ""
    text = ""
    if not given.expanduser().is_absolute():
        text = f" (a relative path is read from the vLLM process's working directory, {Path.cwd()})"
    if shipped:
        text += f"; kvtier ships a config of that name: give its full path, {packaged}"
    return text


def load_vllm_config(value: Any, *, block_tokens: int, engine_id: str, fingerprint: str = "",
                     ranks: int = 1) -> HierarchyConfig:
    """The hierarchy a `kvtier_config` value (`load_raw_config`) runs under vLLM
    (`vllm_hierarchy_config`, `require_cpu_first`). A `ConfigError` names where the config is:
    an inline mapping's fields as `kv_connector_extra_config.kvtier_config.<field>`, a file's
    problems after its path (`source` is set either way)."""
    try:
        raw, source = load_raw_config(value)
    except ConfigError as exc:  # (`source` set by load_raw_config where it knew the config's place)
        raise _named(exc, exc.source) from None
    try:
        config = vllm_hierarchy_config(raw, block_tokens=block_tokens, engine_id=engine_id, fingerprint=fingerprint,
                                       source=source, ranks=ranks)
        require_cpu_first(config)
        return config
    except ConfigError as exc:
        raise _named(exc, source) from None


def _named(exc: ConfigError, source: str | None) -> ConfigError:
    """`exc` with its problems placed: under `INLINE_SOURCE` for an inline mapping, after the
    file's path (`source`) for a file."""
    if source == INLINE_SOURCE:
        error = ConfigError([(f"{source}.{p}", m) if p else
                             ("", m if m.startswith(source) or m.endswith(NOT_SHOWN) else f"{source}: {m}")
                             for p, m in exc.problems])
    else:
        error = ConfigError(exc.problems)
        lines = [f"{p}: {m}" if p else m for p, m in exc.problems]
        if source is not None and not all(source in line for line in lines):
            listed = lines[0] if len(lines) == 1 else f"{count_problems(exc)} problem(s):\n  " + "\n  ".join(lines)
            error.args = (f"kvtier_config {source}: {listed}",)
    error.source = source or exc.source
    return error
