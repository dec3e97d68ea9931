"""`kvtier config check --vllm`: a config resolved as the vLLM connector resolves it at start.

The rules are the connector's own (`kvtier.config_vllm`: `require_cpu_first`, and
`vllm_hierarchy_config`: a `valkey` tier's `tp` is the engine's); what vLLM decides instead of the YAML is said in
notes: tokens and bytes per block come from the engine, the `cpu` tier's `shm_name` from its
`engine_id`, a persistent tier's identity from the served model.
"""

from __future__ import annotations

from typing import Any

from kvtier.config import DEFAULT_BLOCK_TOKENS, HierarchyConfig, load_raw_config_file
from kvtier.config_vllm import PERSISTENT_BACKENDS, require_cpu_first, vllm_hierarchy_config

ENGINE_ID = "ENGINE_ID"  # stands for vLLM's engine_id in the shm_name shown


def load_for_vllm(path: str, import_code: bool) -> tuple[HierarchyConfig, list[str]]:
    """(the config as vLLM would run it, notes on what vLLM decides); `ConfigError` with every problem."""
    raw = load_raw_config_file(path)
    raw = raw if isinstance(raw, dict) else {"tiers": raw}  # anything else: parse_config reports it
    tokens = raw.get("block_tokens")
    tiers = [t for t in raw.get("tiers") or [] if isinstance(t, dict)]
    valkey_tp = [t["tp"] for t in tiers if t.get("backend") == "valkey" and isinstance(t.get("tp"), int)]
    # The engine's values are unknown here: the YAML's stand in for them, so that only the rules
    # that do not depend on them can fail (a differing `tp` is refused at start: see the note).
    config = vllm_hierarchy_config(raw, block_tokens=tokens if isinstance(tokens, int) and _count(tokens)
                                   else DEFAULT_BLOCK_TOKENS,
                                   engine_id=ENGINE_ID, source=path, ranks=valkey_tp[0] if valkey_tp else 1,
                                   import_code=import_code)
    require_cpu_first(config)
    return config, _notes(raw, tiers, valkey_tp)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _notes(raw: dict, tiers: list[dict], valkey_tp: list[int]) -> list[str]:
    notes = ["vllm: tokens per block = the engine's block size x blocks_per_chunk (set 'block_size' in "
             "kv_connector_extra_config)" + (f"; the YAML's block_tokens ({raw['block_tokens']}) is replaced"
                                            if "block_tokens" in raw else "")]
    notes.append("vllm: bytes per block = vLLM's KV bytes per block x blocks_per_chunk x workers, which the YAML "
                 "cannot know: capacities are best written as byte sizes (they bound the memory and disk a tier "
                 "takes whatever the model), 'N blocks' takes N times that size"
                 + ("; the YAML's block_bytes is ignored" if "block_bytes" in raw else ""))
    if any(t.get("backend") == "cpu" and not t.get("shm_name") for t in tiers):
        notes.append(f"vllm: a cpu tier's shm_name is derived from the engine ({ENGINE_ID} above)")
    if any(t.get("backend") in PERSISTENT_BACKENDS for t in tiers):
        notes.append("vllm: file and valkey tiers get the served model and KV layout as their identity, after "
                     "the YAML's fingerprint")
    if valkey_tp:
        notes.append(f"vllm: the valkey tier's tp is the engine's tensor-parallel size; the YAML's {valkey_tp[0]} "
                     f"is refused at start unless it matches (leave tp out)")
    return notes
