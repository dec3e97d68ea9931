"""kvtier's log lines inside a vLLM process: through vLLM's own logging configuration."""

from __future__ import annotations

import logging
from typing import Any


def log_through_vllm() -> None:
    """Send the `kvtier` loggers' records to the handlers vLLM configured for its `vllm` logger.

    vLLM configures only its own logger (propagate off, nothing on the root logger), so kvtier's
    INFO lines - the tier summary at start-up - reached no handler and the server's log never
    showed them. This gives the `kvtier` logger vLLM's handlers (format, stream, level) unless it
    has handlers already (the user configured kvtier's logging: left alone) or vLLM has none
    (VLLM_CONFIGURE_LOGGING=0). Records still propagate to the root logger, which has no handler
    in a vLLM server, so nothing is printed twice there. Idempotent."""
    kvtier, vllm = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if kvtier.handlers or not vllm.handlers:
        return
    for handler in vllm.handlers:
        kvtier.addHandler(handler)
    if kvtier.level == logging.NOTSET:
        kvtier.setLevel(vllm.getEffectiveLevel())


def _size(n: float) -> str:
    """Bytes as a short human-readable size (`512 B`, `1.5 MiB`)."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def tier_summary(hierarchy: Any, block_tokens: int, block_bytes: int) -> str:
    """The start-up line: the config's source, the block geometry, and per tier its size in
    blocks and bytes, its medium, and where it lives (a CPU tier's region name; a file tier's
    root_dir, a shared tier's server and tenant prefix, and the fingerprint that guards them)."""
    options = {t.name: t.options for t in hierarchy.config.tiers}
    parts = []
    for tier in hierarchy.manager.tiers:
        where = options.get(tier.name, {})
        if tier.medium == "CPU":
            place = f"shm_name={where.get('shm_name')}"
        elif tier.medium == "REMOTE":
            place = (f"url={where.get('url')}, key_prefix={where.get('key_prefix')}, "
                     f"fingerprint={where.get('fingerprint')!r}")
        else:
            place = (f"root_dir={getattr(tier.backend, 'root', None) or where.get('root_dir')}, "
                     f"fingerprint={where.get('fingerprint')!r}")
        size = _size(tier.capacity * block_bytes)
        parts.append(f"{tier.name}={tier.capacity} blocks / {size} ({tier.medium}, {place})")
    return (f"kvtier: hierarchy {hierarchy.config.source} with blocks of {block_tokens} tokens / {block_bytes} bytes: "
            + "; ".join(parts))
