"""Server keys of blocks: `{prefix}:{identity tag}:{rank}of{tp}:{block hash hex}:{group}`.

- `prefix` is the tenant's namespace (`key_prefix`); an ACL user limited to `~{prefix}:*` can use
  exactly its own keys. Validated: printable ASCII without spaces, `{`, `}` (a hash tag would pin all
  keys to one shard) or glob characters `*?[]\\` (they would change the meaning of the ACL pattern).
- `identity tag` is 16 hex digits of a digest of fingerprint and layout: a fingerprint may contain
  `:` or be long; the full 16-byte digest is checked again in every value's trailer.
- `rank` of `tp`: one value per tensor-parallel part of the block (store.py).
- `block hash hex` and `group` come from the `OffloadKey` (kvtier/core/keys.py: hash bytes + 4-byte
  big-endian group index); the group is written in decimal.

No hash tags: a block's parts and neighbouring blocks spread over a cluster's shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.core.errors import ArgumentError, ArgumentTypeError
from kvtier.core.keys import GROUP_BYTES

MAX_PREFIX_CHARS = 128
_FORBIDDEN_IN_PREFIX = set("{}*?[]\\")
IDENTITY_DIGEST_BYTES = 16
KEY_DIGEST_BYTES = 8


def validate_key_prefix(prefix: str, where: str = "key_prefix") -> str:
    """`prefix` when usable as a key namespace, else ValueError naming `where` and the fault."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"{where}: expected a non-empty string such as 'kvt:tenantA', got {prefix!r}")
    if len(prefix) > MAX_PREFIX_CHARS:
        raise ValueError(f"{where}: {len(prefix)} characters, at most {MAX_PREFIX_CHARS}")
    bad = sorted({c for c in prefix if not (c.isascii() and c.isprintable()) or c.isspace()
                  or c in _FORBIDDEN_IN_PREFIX})
    if bad:
        raise ValueError(f"{where}: {prefix!r} contains {bad}; use printable ASCII without spaces, "
                         "'{', '}' (hash tags) or glob characters '*?[]\\' (ACL key patterns)")
    if prefix.endswith(":"):
        raise ValueError(f"{where}: {prefix!r} ends with ':'; the separator is added (keys are '{prefix}:...')")
    return prefix


def identity_digest(fingerprint: str, layout: str) -> bytes:
    """16-byte digest of a model fingerprint and a KV layout (a value of another identity is foreign)."""
    for name, value in (("fingerprint", fingerprint), ("layout", layout)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    data = b"kvtier-remote-identity\0" + fingerprint.encode() + b"\0" + layout.encode()
    return hashlib.blake2b(data, digest_size=IDENTITY_DIGEST_BYTES).digest()


def key_digest(server_key: bytes) -> bytes:
    """8-byte digest of a full server key, stored in its value: a value copied (or renamed) under
    another key, rank or tenant is recognised as foreign."""
    return hashlib.blake2b(server_key, digest_size=KEY_DIGEST_BYTES).digest()


class KeyScheme:
    """The server keys of one identity, tenant and tensor-parallel degree."""

    def __init__(self, prefix: str, fingerprint: str, layout: str, tp: int = 1):
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp: expected an integer >= 1, got {tp!r}")
        self.prefix = validate_key_prefix(prefix)
        self.identity = identity_digest(fingerprint, layout)
        self.tag = self.identity[:8].hex()
        self.tp = tp
        self.namespace = f"{self.prefix}:{self.tag}"  # every key of this scheme starts with it + ':'
        self._ranks = [f"{self.namespace}:{r}of{tp}:".encode() for r in range(tp)]

    def part_keys(self, key: bytes) -> list[bytes]:
        """The `tp` server keys of the block named by the OffloadKey `key`, rank 0 first."""
        if not isinstance(key, bytes):
            raise ArgumentTypeError(f"key: expected an OffloadKey (bytes), got {type(key).__name__}")
        if len(key) <= GROUP_BYTES:
            raise ArgumentError(f"key: {len(key)} bytes; an OffloadKey is a block hash + {GROUP_BYTES} group bytes")
        tail = b"%s:%d" % (key[:-GROUP_BYTES].hex().encode(), int.from_bytes(key[-GROUP_BYTES:], "big"))
        return [rank + tail for rank in self._ranks]

    def all_part_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """`part_keys` of every key, flattened (key i's parts at [i*tp, (i+1)*tp))."""
        return [part for key in keys for part in self.part_keys(key)]
