"""The block table of a tier (key -> slot, block state, load pins), apart from its policy (which
blocks leave): `BlockTable`, `PolicyTable`, `table_of`. See `kvtier.index.table`."""

from kvtier.index.table import BlockTable, PolicyTable, table_of

__all__ = ["BlockTable", "PolicyTable", "table_of"]
