"""A kvtier config under vLLM: where it comes from (`kvtier_config`); what vLLM decides in it and
requires of it is `kvtier.config.vllm` (vLLM-free, shared with `kvtier config check --vllm`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import default_config_path
from kvtier.config.input import plain
from kvtier.config.vllm import is_persistent, vllm_hierarchy_config

__all__ = ["is_persistent", "load_raw_config", "vllm_hierarchy_config"]


def load_raw_config(value: Any) -> tuple[dict[str, Any], str]:
    """`kvtier_config` (a YAML path, an inline mapping, or None for kvtier's default) -> (dict, source).

    A file is read and an inline mapping copied under the limits of `kvtier.config.input` (size,
    nesting, values counted through aliases or shared objects, no cycles): a `ConfigError` naming
    the field, never a hang, whatever the keys it sits under."""
    from kvtier.config import load_raw_config_file
    from kvtier.core.errors import ConfigError

    if value is None:
        path = default_config_path()
        return load_raw_config_file(path), str(path)
    if isinstance(value, Mapping):
        return plain(value), "<kv_connector_extra_config.kvtier_config>"
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        try:
            return load_raw_config_file(path), str(path)
        except ConfigError as exc:  # problems of the file as a whole are problems of `kvtier_config`
            raise ConfigError([(p or "kvtier_config", m) for p, m in exc.problems]) from None
    raise TypeError(f"kvtier_config must be a path or a mapping, got {type(value).__name__}")
