"""A kvtier config under vLLM: where it comes from (`kvtier_config`) and what vLLM decides in it."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import HierarchyConfig, default_config_path, parse_config
from kvtier.config_input import brief, plain
from kvtier.hierarchy import tier_identity

log = logging.getLogger(__name__)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


def load_raw_config(value: Any) -> tuple[dict[str, Any], str]:
    """`kvtier_config` (a YAML path, an inline mapping, or None for kvtier's default) -> (dict, source).

    A file is read and an inline mapping copied under the limits of `kvtier.config_input` (size,
    nesting, values counted through aliases or shared objects, no cycles): a `ConfigError` naming
    the field, never a hang, whatever the keys it sits under."""
    from kvtier.config import load_raw_config_file
    from kvtier.errors import ConfigError

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


PERSISTENT_BACKENDS = ("file", "valkey")  # tiers whose blocks outlive the engine: they get its identity


def vllm_hierarchy_config(raw: Mapping[str, Any], *, block_tokens: int, engine_id: str, fingerprint: str = "",
                          source: str = "<dict>", ranks: int = 1) -> HierarchyConfig:
    """Validate a kvtier config for use under vLLM: `block_tokens` is vLLM's, `block_bytes` is
    dropped (the caller passes vLLM's), each `cpu` tier without `shm_name` gets one derived from
    `engine_id` (so that workers can attach it by name) and each `file` or `valkey` tier's
    `fingerprint` gets `fingerprint` (model, dtype and KV geometry), after the YAML's own value
    when it sets one (e.g. the model's revision): a root_dir or a server's values written for
    another model or layout are then not served. The YAML's value adds to the derived identity, never replaces it.
    Each `valkey` tier gets `tp` = `ranks` (the engine's tensor-parallel size: a block is stored as one
    value per rank); a YAML `tp` that differs is a `ConfigError` naming it."""
    raw = plain(raw)
    if not isinstance(raw, dict):
        return parse_config(raw, source)  # reports the error
    yaml_tokens = raw.get("block_tokens")
    if yaml_tokens is not None and yaml_tokens != block_tokens:
        log.warning("kvtier: %s says block_tokens=%s but vLLM offloads blocks of %d tokens "
                    "(engine block size x blocks_per_chunk); using %d. Set 'block_size' in "
                    "kv_connector_extra_config to change it.", source, brief(yaml_tokens), block_tokens, block_tokens)
    raw["block_tokens"] = block_tokens
    if raw.pop("block_bytes", None) is not None:
        log.info("kvtier: block_bytes of %s ignored: vLLM's KV geometry decides it", source)
    for tier in raw.get("tiers") or []:
        if isinstance(tier, dict) and tier.get("backend") == "cpu" and not tier.get("shm_name"):
            tier["shm_name"] = f"kvtier-{_safe_name(engine_id)}-{_safe_name(str(tier.get('name')))}"
        if isinstance(tier, dict) and tier.get("backend") in PERSISTENT_BACKENDS and fingerprint:
            own = tier.get("fingerprint") or ""
            if isinstance(own, str):  # anything else is reported by parse_config
                tier["fingerprint"] = tier_identity(own, fingerprint)
    for i, tier in enumerate(raw.get("tiers") or []):
        if isinstance(tier, dict) and tier.get("backend") == "valkey":
            given = tier.setdefault("tp", ranks)
            if given != ranks:
                from kvtier.errors import ConfigError

                raise ConfigError([(f"tiers[{i}].tp", f"{brief(given)} in {source}, but this engine has {ranks} "
                                    f"tensor-parallel ranks; leave tp out (vLLM's value is used)")])
    return parse_config(raw, source)

