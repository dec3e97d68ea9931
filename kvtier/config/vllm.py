"""vLLM's rules for a kvtier config, without vLLM: what vLLM decides in it and what it requires.

Used by the vLLM connector (`kvtier.integrations.vllm`, which re-exports `vllm_hierarchy_config`)
when it starts, and by `kvtier config check --vllm`, so that both apply the same rules (docs/vllm.md,
"What vLLM decides, not the YAML"): tokens per block come from the engine, `block_bytes` is vLLM's,
the first tier is a `cpu` tier (the region the workers copy to and from), each `cpu` tier gets a
`shm_name` derived from the engine, each persistent tier the engine's identity, each `valkey` tier
the engine's tensor-parallel size as `tp`, each `file` tier the same as `part_checks` (a checksum
per rank's part of each slot, so that each rank verifies the bytes it reads itself). Also the
keys of `kv_connector_extra_config` the spec knows (`read_extra_config`): a misspelt key or a bad
value is refused at start, before anything is built.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from kvtier.config import TOP_FIELDS, HierarchyConfig, parse_config
from kvtier.config.input import brief, plain
from kvtier.config.problems import Problems, read_fields
from kvtier.core.errors import ConfigError
from kvtier.core.identity import tier_identity
from kvtier.transfer import registry

log = logging.getLogger("kvtier.integrations.vllm.config")  # the connector's logger, as before the move

FIRST_BACKEND = "cpu"


def is_persistent(backend: Any, import_code: bool = True) -> bool:
    """Whether tiers of `backend` (a YAML backend name) keep blocks past the engine, so they get
    its identity: the class's `Backend.persistent`, for a registered name, or with `import_code`
    a "package.module:Class" one. False when the class cannot be loaded (`parse_config` says why)."""
    if not isinstance(backend, str) or (backend not in registry.BACKENDS and not import_code):
        return False
    try:
        return bool(getattr(registry.load_class(registry.BACKEND, backend, "backend"), "persistent", False))
    except ConfigError:
        return False


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80]


def vllm_hierarchy_config(raw: Mapping[str, Any], *, block_tokens: int, engine_id: str, fingerprint: str = "",
                          source: str = "<dict>", ranks: int = 1, import_code: bool = True) -> HierarchyConfig:
    """Validate a kvtier config for use under vLLM: `block_tokens` is vLLM's, `block_bytes` is
    dropped (the caller passes vLLM's), each `cpu` tier without `shm_name` gets one derived from
    `engine_id` (so that workers can attach it by name) and each persistent tier's (`is_persistent`:
    file, valkey, any backend class with `persistent`) `fingerprint` gets `fingerprint` (model,
    dtype and KV geometry), after the YAML's own value
    when it sets one (e.g. the model's revision): a root_dir or a server's values written for
    another model or layout are then not served. The YAML's value adds to the derived identity, never replaces it.
    Each `valkey` tier gets `tp` = `ranks` (the engine's tensor-parallel size: a block is stored as one
    value per rank), each `file` tier `part_checks` = `ranks` (a checksum per rank's part of a slot:
    a worker rank reading the tier directly verifies exactly its bytes); a YAML value that differs
    is a problem naming it (null, as anywhere in the YAML, means "not given"). Every problem is
    reported at once, in one `ConfigError` with `source` set. The connector then applies
    `require_cpu_first`."""
    raw = plain(raw)
    if not isinstance(raw, dict):
        return parse_config(raw, source, import_code=import_code)  # reports the error
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
        if isinstance(tier, dict) and fingerprint and is_persistent(tier.get("backend"), import_code):
            own = tier.get("fingerprint") or ""
            if isinstance(own, str):  # anything else is reported by parse_config
                tier["fingerprint"] = tier_identity(own, fingerprint)
    problems = _per_rank_problems(raw, ranks, source)
    try:
        config = parse_config(raw, source, import_code=import_code)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        error = ConfigError(problems)
        error.source = source
        raise error
    return config


PER_RANK = {"valkey": "tp", "file": "part_checks"}  # the tier option that says how many ranks share a block


def _per_rank_problems(raw: dict[str, Any], ranks: int, source: str) -> list[tuple[str, str]]:
    """Set each per-rank option (`PER_RANK`) of `raw`'s tiers to `ranks`; a problem for each that
    the YAML gives another value (null: not given)."""
    problems = []
    tiers = raw.get("tiers")
    for i, tier in enumerate(tiers if isinstance(tiers, list) else []):
        field = PER_RANK.get(str(tier.get("backend"))) if isinstance(tier, dict) else None
        if field is None:
            continue
        given = tier.get(field)
        tier[field] = ranks  # (a differing value is this problem, not also parse_config's)
        if given is not None and (type(given) is not int or given != ranks):
            problems.append((f"tiers[{i}].{field}", f"{brief(given)} in {source}, but this engine has {ranks} "
                             f"tensor-parallel ranks; leave {field} out (vLLM's value is used)"))
    return problems


def require_cpu_first(config: HierarchyConfig) -> None:
    """`ConfigError` on `tiers[0].backend` unless the first tier is a `cpu` tier: under vLLM it is
    the shared-memory region the workers copy to and from (a `vllm_hierarchy_config` alone, e.g.
    in tests, may start with another tier)."""
    if config.tiers[0].backend != FIRST_BACKEND:
        raise ConfigError([("tiers[0].backend", f"under vLLM the first tier must use backend '{FIRST_BACKEND}' "
                                                f"(the shared-memory region the workers copy to and from), got "
                                                f"{config.tiers[0].backend!r}")])


# ------------------------------------------------------------------ kv_connector_extra_config
EXTRA_CONFIG = "kv_connector_extra_config"
MAX_TRACKER_SIZE = 1 << 24  # keys the store threshold's table may count (~140 bytes each: ~2.3 GiB)
# vLLM's own keys, read by its OffloadingConnector or by every OffloadingSpec (vLLM 0.32:
# kv_offload/factory.py, offloading/config.py, kv_offload/base.py; 0.33 adds the scheduler's
# sync_load_budget_bytes).
VLLM_EXTRA_KEYS = ("spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
                   "self_describing_kv_events", "offload_prompt_only", "sync_load_budget_bytes")
# Keys of vLLM's own specs (its CPUOffloadingSpec: `cpu_bytes_to_use` is also what
# `--kv-offloading-size` sets; its tiering spec): accepted, but kvtier's tiers come from
# `kvtier_config` (`ignored_extra_keys`).
CPU_SPEC_KEYS = ("cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path", "secondary_tiers",
                 "tier_poll_interval_s", "backpressure", "enable_telemetry")


def _direct_file_loads(value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {brief(value)}")
    return value


def _max_tracker_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TRACKER_SIZE:
        raise ValueError(f"expected a positive integer up to {MAX_TRACKER_SIZE}, got {brief(value)}")
    return value


# kvtier's keys: name -> (value when not given or null, check), as the YAML's fields (kvtier.config).
EXTRA_FIELDS: dict[str, tuple[Any, Any]] = {
    "kvtier_config": (None, None),  # read by kvtier.integrations.vllm.config.load_raw_config
    "direct_file_loads": (None, _direct_file_loads),  # None: direct where allowed
    "store_threshold": (None, TOP_FIELDS["store_threshold"][1]),  # None: the YAML's; the YAML's own check
    "max_tracker_size": (None, _max_tracker_size),  # None: vLLM's default (kvtier.control.store_threshold)
}


def read_extra_config(extra: Mapping[str, Any], own_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """kvtier's keys of `kv_connector_extra_config` (`EXTRA_FIELDS`), checked as the YAML's fields
    are: a `ConfigError` (`source` = "kv_connector_extra_config") lists every value refused and
    every key that is neither kvtier's nor vLLM's (`VLLM_EXTRA_KEYS`, `CPU_SPEC_KEYS`) nor one of
    `own_keys` (those a subclass of the spec reads itself), with the closest known key, so that a
    misspelt key is not silently ignored."""
    problems = Problems()
    known = dict.fromkeys((*VLLM_EXTRA_KEYS, *CPU_SPEC_KEYS, *own_keys))
    values = read_fields(extra, EXTRA_FIELDS, f"{EXTRA_CONFIG}.", problems, "KVTierOffloadingSpec", also_valid=known)
    if problems.items:
        error = problems.error()
        error.source = EXTRA_CONFIG
        raise error
    return values


def ignored_extra_keys(extra: Mapping[str, Any]) -> list[str]:
    """The keys of `extra` that only vLLM's CPUOffloadingSpec reads (`CPU_SPEC_KEYS`)."""
    return [key for key in CPU_SPEC_KEYS if extra.get(key) is not None]
