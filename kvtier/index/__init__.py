"""The block table of a tier (key -> slot, block state, load pins), apart from its policy (which
blocks leave): `BlockTable`, `PureTable` (composed with an `Order`), `PolicyTable` (over a policy
written to vLLM's contract), `table_of`. See `kvtier.index.table`.

The compiled table (`_table.pxd` / `_table.pyx`, its Python-visible base class in `_table_api.pyx`;
built by setup.py, optional) is not imported here: the compiled policies `cimport` it."""

from kvtier.index.pure import Order, PureTable
from kvtier.index.table import BlockTable, PolicyTable, table_of

__all__ = ["BlockTable", "Order", "PolicyTable", "PureTable", "table_of"]
