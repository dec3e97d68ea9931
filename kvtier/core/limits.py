"""Every limit on the size of a hierarchy, stated once (README, "Limits").

`kvtier config check`, `build_hierarchy` and `kvtier bench --capacities` check a tier's block
count with `tier_blocks_problem`, against what the tier's backend and its policy can hold:

- any tier: at most `MAX_BLOCKS` blocks, and a size at most `MAX_BYTES`;
- a backend (`Backend.max_blocks`; None for every built-in backend: cpu and memory slots are
  bounded by memory, file slots by the disk, both checked when the tier is built, and a valkey
  tier's handles cost nothing until they are remembered);
- a policy (`max_blocks` on its class): the compiled `lru` and `prefix-freq` indexes number their
  entries with int32, so at most `MAX_INDEX_BLOCKS`; they allocate as blocks arrive, so a large
  capacity costs nothing up front. The pure-Python policies have no limit of their own.

Keys: the compiled indexes hold keys of up to `MAX_KEY_BYTES` bytes (their `max_key_bytes`),
each costing its own length; a backend may hold less (`Backend.max_key_bytes`: the file tier's
slot header holds 480 bytes).

Identities: a persistent tier records whose KV it holds (its `fingerprint` and the `model` given
to `KVTier.open`/`build_hierarchy`, or under vLLM the served model's identity) and the KV layout,
each at most `MAX_IDENTITY_BYTES` of UTF-8 (`identity_problem`): the file tier's manifest holds
both and must stay within the bound it is read back with (`MANIFEST_MAX_BYTES`, 1 MiB), even with
every character escaped in JSON (6 bytes each at worst).

Only the standard library is imported here: every layer may use these names.
"""

from __future__ import annotations

from typing import Any

MAX_BYTES = 1 << 60  # 1 EiB: more than any memory or disk, and byte offsets stay below 2**63
MAX_BLOCKS = 10**12  # blocks of any tier
MAX_BLOCK_TOKENS = 1 << 20  # tokens per block
MAX_INDEX_BLOCKS = 1 << 30  # blocks of a compiled policy index (int32 entry numbers)
MAX_KEY_BYTES = 65535  # bytes of a key in a compiled policy index (a uint16 length)
MAX_IDENTITY_BYTES = 16 << 10  # UTF-8 bytes of a tier's identity (fingerprint + model) and of its KV layout


IDENTITY_ADVICE = ("give a short identity of the model whose KV this is, e.g. 'org/model@revision' (a long "
                   "description can be replaced by a digest of it)")


def identity_problem(value: str) -> str | None:
    """Why `value` cannot be a tier's identity (or its layout), and what would do, or None if it
    can: more than `MAX_IDENTITY_BYTES` bytes of UTF-8, or text that has no UTF-8 form (a lone
    surrogate). Never encodes more than `MAX_IDENTITY_BYTES` characters."""
    if len(value) > MAX_IDENTITY_BYTES:
        why = f"{len(value)} characters, more than the {MAX_IDENTITY_BYTES} bytes (UTF-8) an identity may hold"
    else:
        try:
            size = len(value.encode())
        except UnicodeEncodeError as exc:
            return f"not UTF-8 text ({exc.reason} at character {exc.start}); {IDENTITY_ADVICE}"
        if size <= MAX_IDENTITY_BYTES:
            return None
        why = f"{size} bytes (UTF-8), more than the {MAX_IDENTITY_BYTES} an identity may hold"
    return f"{why}; {IDENTITY_ADVICE}"


def max_blocks_of(cls: Any) -> int | None:
    """The `max_blocks` a backend or policy class states (None: no limit of its own, or not stated)."""
    limit = getattr(cls, "max_blocks", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def tier_block_limit(backend: Any = None, policy: Any = None, *, backend_name: str = "",
                     policy_name: str = "") -> tuple[int, str]:
    """The most blocks a tier of `backend` (a class) with `policy` (a class) can hold, and what
    sets it, for a message ("any tier", "backend 'valkey'", "policy 'lru'"; the names default to
    the class names). Either class may be None (not known: not checked)."""
    limit, why = MAX_BLOCKS, "any tier"
    for what, cls, name in (("backend", backend, backend_name), ("policy", policy, policy_name)):
        own = max_blocks_of(cls)
        if own is not None and own < limit:
            limit, why = own, f"{what} {name or getattr(cls, '__name__', '?')!r}"
    return limit, why


def tier_blocks_problem(blocks: int, backend: Any = None, policy: Any = None, *, backend_name: str = "",
                        policy_name: str = "") -> str | None:
    """Why a tier of `backend` with `policy` (classes, or None: not checked) cannot hold `blocks`
    blocks, or None if it can. The same check for `config check`, the build and the bench."""
    if blocks < 1:
        return f"{blocks} blocks: a tier holds at least 1 block"
    limit, why = tier_block_limit(backend, policy, backend_name=backend_name, policy_name=policy_name)
    if blocks > limit:
        hint = "; lower the capacity" + (" or choose a policy without this limit (e.g. arc)"
                                         if why.startswith("policy") else "")
        return f"{blocks} blocks is more than {why} can hold (at most {limit} blocks){hint}"
    return None
