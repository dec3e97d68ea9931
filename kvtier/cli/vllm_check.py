"""`kvtier config check --vllm`: a config resolved as the vLLM connector resolves it at start.

The rules are the connector's own (`kvtier.config.vllm`: `require_cpu_first`, and
`vllm_hierarchy_config`: a `valkey` tier's `tp` and a `file` tier's `part_checks` are the engine's
tensor-parallel size); what vLLM decides instead of the YAML is said in notes: tokens and bytes per
block come from the engine, the `cpu` tier's `shm_name` from its `engine_id`, a persistent tier's
identity from the served model; and which path loads of file-tier blocks take (`LOAD_PATHS`).
"""

from __future__ import annotations

from typing import Any

from kvtier.config import DEFAULT_BLOCK_TOKENS, HierarchyConfig, load_raw_config_file, parse_config
from kvtier.config.vllm import is_persistent, require_cpu_first, vllm_hierarchy_config
from kvtier.core.errors import ConfigError

ENGINE_ID = "ENGINE_ID"  # stands for vLLM's engine_id in the shm_name shown
PER_RANK = {"valkey": "tp", "file": "part_checks"}  # tier options that vLLM sets to its tensor-parallel size
# How a file tier's blocks reach the engine, by connector and option (docs/vllm.md, "Direct file loads").
LOAD_PATHS = ("under KVTierOffloadingConnector, loaded by each worker process directly (every executor, every "
              "tensor-parallel rank: each opens the tier read-only and verifies the part of each block it reads, "
              "whose checksum the tier writes: part_checks = the engine's tensor-parallel size); "
              "promoted into the CPU tier and verified there under vLLM's OffloadingConnector (a failed load would "
              "stop the engine), with direct_file_loads: false, and on a vLLM with synchronous loads (0.33) unless "
              "direct_file_loads: true")


def load_for_vllm(path: str, import_code: bool) -> tuple[HierarchyConfig, list[str]]:
    """(the config as vLLM would run it, notes on what vLLM decides); `ConfigError` with every problem."""
    raw = load_raw_config_file(path)
    if not isinstance(raw, dict):  # (as the connector: a mapping, or parse_config's own refusal)
        parse_config(raw, path, import_code=False)
        raise ConfigError([("", f"{path}: the config must be a mapping with a 'tiers' list")])
    tokens = raw.get("block_tokens")
    tiers = [t for t in raw.get("tiers") or [] if isinstance(t, dict)]
    per_rank = [(str(t["backend"]), int(t[PER_RANK[t["backend"]]])) for t in tiers if t.get("backend") in PER_RANK
                and isinstance(t.get(PER_RANK[t["backend"]]), int)]
    # The engine's values are unknown here: the YAML's stand in for them, so that only the rules
    # that do not depend on them can fail (a differing `tp` is refused at start: see the note).
    config = vllm_hierarchy_config(raw, block_tokens=tokens if isinstance(tokens, int) and _count(tokens)
                                   else DEFAULT_BLOCK_TOKENS,
                                   engine_id=ENGINE_ID, source=path, ranks=per_rank[0][1] if per_rank else 1,
                                   import_code=import_code)
    require_cpu_first(config)
    return config, _notes(raw, tiers, per_rank)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _notes(raw: dict, tiers: list[dict], per_rank: list[tuple[str, int]]) -> list[str]:
    notes = ["vllm: tokens per block = the engine's block size x blocks_per_chunk (set 'block_size' in "
             "kv_connector_extra_config)" + (f"; the YAML's block_tokens ({raw['block_tokens']}) is replaced"
                                            if "block_tokens" in raw else "")]
    notes.append("vllm: bytes per block = vLLM's KV bytes per block x blocks_per_chunk x workers, which the YAML "
                 "cannot know: capacities are best written as byte sizes (they bound the memory and disk a tier "
                 "takes whatever the model), 'N blocks' takes N times that size"
                 + ("; the YAML's block_bytes is ignored" if "block_bytes" in raw else ""))
    if any(t.get("backend") == "cpu" and not t.get("shm_name") for t in tiers):
        notes.append(f"vllm: a cpu tier's shm_name is derived from the engine ({ENGINE_ID} above)")
    persistent = [str(t.get("name")) for t in tiers if is_persistent(t.get("backend"), import_code=False)]
    if persistent:
        notes.append(f"vllm: tier(s) {', '.join(persistent)} keep blocks past the engine and get the served model "
                     "and KV layout as their identity, after the YAML's fingerprint")
    for backend, value in per_rank:
        field = PER_RANK[backend]
        notes.append(f"vllm: the {backend} tier's {field} is the engine's tensor-parallel size; the YAML's {value} "
                     f"is refused at start unless it matches (leave {field} out)")
    files = [str(t.get("name")) for t in tiers if t.get("backend") == "file"]
    if files:
        notes.append(f"vllm: file tier(s) {', '.join(files)}: {LOAD_PATHS}")
    return notes
