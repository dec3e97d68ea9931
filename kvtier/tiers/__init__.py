"""The tiers: one package per backend kind (`cpu/`, `file/`, `remote/`), each holding its backend,
its options and its own I/O (and, for `remote/`, its client and its handler), beside `base` (the
`Backend` contract), `memory` (a process-local tier), `room` (the machine's room, for each
backend's `capacity_problem`) and `owners`.

Backends import no config module (kvtier.config / kvtier.config.input, checked by
tests/tiers/test_backend_imports.py) and nothing of the control plane. A handler kept in a tier's
package (remote/handler.py) builds on kvtier.transfer.handlers.base, as the other handlers do."""
