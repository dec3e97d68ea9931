"""`Backend`: a kind of storage that owns slots and hands out `LoadStoreSpec`s for them.

A backend never calls another backend and never decides what to evict; the manager does both.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvtier.core.keys import OffloadKey
from kvtier.core.specs import BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from kvtier.core.types import BlockStatus

_block_id = attrgetter("block_id")
_PLAIN_INIT = BlockIDsLoadStoreSpec.__init__
_PLAIN_FOR_BLOCKS = getattr(BlockIDsLoadStoreSpec.for_blocks, "__func__", None)
_PLAIN_SPECS: dict[type, bool] = {}  # spec type -> whether it is built from slot numbers alone (as checked once)


class SlotAllocator:
    """Hands out slot numbers `0..num_slots-1`; freed slots are reused first (LIFO)."""

    __slots__ = ("num_slots", "_next_fresh", "_free")

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._next_fresh = 0
        self._free: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._next_fresh

    def allocate(self, n: int) -> list[int]:
        """`n` distinct free slots. Raises `RuntimeError` if fewer are free (callers check first)."""
        free = self._free
        if n > len(free) + self.num_slots - self._next_fresh:  # (`num_free`)
            raise RuntimeError(f"asked for {n} slots, only {self.num_free} free")
        reused = min(n, len(free))
        cut = len(free) - reused
        slots = free[cut:]
        slots.reverse()  # the most recently freed first, as pop() would give them
        del free[cut:]
        fresh = n - reused
        slots.extend(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        return slots

    def claim(self, slot: int) -> None:
        """Mark a specific slot used (recovering a tier after a restart)."""
        if slot >= self._next_fresh:
            self._free.extend(range(self._next_fresh, slot))
            self._next_fresh = slot + 1
        else:
            self._free.remove(slot)

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def release_many(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)


class _SeedSlots(SlotAllocator):
    """The slots of a backend built with vLLM's earlier `Backend(block_size, medium)` form: it
    manages its own, so kvtier's slot defaults must not be used; each says so instead of guessing."""

    __slots__ = ("owner",)

    def __init__(self, owner: str):
        self.owner = owner
        self.num_slots = self._next_fresh = 0
        self._free = []

    def _refuse(self, *_args: Any) -> Any:
        raise NotImplementedError(f"{self.owner} was built with vLLM's earlier Backend(block_size, medium): it must "
                                  "implement get_num_free_blocks, allocate_blocks and free itself")

    num_free = property(_refuse)
    allocate = claim = release = release_many = _refuse  # type: ignore[assignment]


class Backend(ABC):
    """Storage for fixed-size blocks in one medium.

    `spec_type` is the `LoadStoreSpec` class this backend hands out; the router uses it to find
    the handler of a hop. `block_bytes` is the size of one block; `num_blocks` the capacity.

    No method is abstract: slot bookkeeping (`get_num_free_blocks`, `allocate_blocks`, `free`,
    the methods the `Backend` of vLLM's earlier kv_offload API requires) defaults to `self.slots`,
    and everything kvtier added on top (`close`, `recover`, `still_valid`, ...) has a safe default,
    so a subclass written to that contract works unchanged (docs/glossary.md).
    """

    spec_type: ClassVar[type[BlockIDsLoadStoreSpec]]
    medium: ClassVar[str]
    # The longest key, in bytes, this backend can hold (None: no limit). Front-ends refuse longer
    # keys up front: a block this tier cannot hold would otherwise fail every move into it.
    max_key_bytes: ClassVar[int | None] = None
    # The most blocks (slots, handles) a tier of this backend can have, whatever its policy holds
    # (None: no limit of its own). `config check` and the build check a tier's capacity against
    # it and its policy's `max_blocks` alike (`kvtier.core.limits.tier_blocks_problem`).
    max_blocks: ClassVar[int | None] = None
    # True when blocks outlive the process (a restart finds them). `build_hierarchy` then passes
    # the constructor `fingerprint` (whose KV this is, never empty) and `layout` (block geometry,
    # dtypes and shapes; see `kvtier.control.hierarchy.describe_layout`), and the backend must never serve
    # a block written under another pair.
    persistent: ClassVar[bool] = False
    # True for a tier shared with other processes through a server (Valkey/Redis): it comes after
    # every local tier, is fed by publishing the first tier's stores and read by promotion into
    # the first tier, never by the cascade (see `kvtier.control.shared_probes`).
    shared: ClassVar[bool] = False
    # The hops this kind of tier brings: (source spec type, destination spec type, factory), the
    # factory a callable or its "module:attr" path (`kvtier.transfer.registry.register_handler`).
    # The registry enters them when it loads the class, so a tier kind is one package (backend,
    # spec, handlers) and, for a short YAML name, one line in `registry.BACKENDS`.
    handlers: ClassVar[tuple[tuple[type[LoadStoreSpec], type[LoadStoreSpec], Any], ...]] = ()

    def __init__(self, name: str | int = "", num_blocks: int | str = 0, block_bytes: int = 0,
                 block_size: int = 0, medium: str | None = None):
        """kvtier's form: `Backend(name, num_blocks, block_bytes, block_size=0)`.

        vLLM's earlier form, `Backend(block_size, medium)` (positional or by keyword), is accepted too,
        for a backend written to vLLM's contract: it implements `get_num_free_blocks`,
        `allocate_blocks` and `free` itself, so no slot allocator is made (the defaults raise).
        """
        if isinstance(name, int) and isinstance(num_blocks, str):  # vLLM's earlier positional order
            block_size, medium = name, num_blocks
            name, num_blocks = "", 0
        if medium is not None:
            vars(self)["medium"] = medium  # per instance, as vLLM's earlier constructor set it
        if not isinstance(name, str) or not isinstance(num_blocks, int):
            raise TypeError(f"Backend(name: str, num_blocks: int, ...) or Backend(block_size: int, medium: str), "
                            f"got name={name!r}, num_blocks={num_blocks!r}")
        self.name = name or (medium or type(self).__name__).lower()
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.block_size = block_size  # tokens per block, reported in events
        self.slots = SlotAllocator(num_blocks) if medium is None or num_blocks else _SeedSlots(type(self).__name__)

    # Backend-specific YAML keys: name -> (default or kvtier.core.types.REQUIRED, validator). See kvtier.config.
    OPTIONS: ClassVar[dict] = {}

    @classmethod
    def check_options(cls, options: dict) -> list[tuple[str, str]]:
        """Problems between options (each checked alone by `OPTIONS`): `(option name, message)`
        pairs, reported by `kvtier config check` with the tier's path. Default: none."""
        return []

    @classmethod
    def check_environment(cls, options: dict) -> tuple[list[str], list[tuple[str, str]]]:
        """What this machine would make of the options when the tier is built (the files and
        environment variables it reads), changing nothing: (notes, problems as `(option name,
        message)` pairs), for `kvtier config check --env`. Default: nothing to check."""
        return [], []

    @classmethod
    def capacity_problem(cls, need_bytes: int, options: Mapping[str, Any]) -> str | None:
        """Why `need_bytes` of this tier (its capacity in bytes) cannot fit on this machine, with the
        tier's `options`: checked by the build and `kvtier config check` before anything is
        allocated (kvtier/tiers/room.py measures the room). None if they fit, if nobody knows, or
        if the backend has no rule. Default: no rule."""
        return None

    @classmethod
    def from_config(cls, name: str, num_blocks: int, block_bytes: int, block_size: int, options: dict) -> Backend:
        """Create the backend of a configured tier (`options` validated against `OPTIONS`)."""
        return cls(name, num_blocks, block_bytes, block_size, **options)

    def get_num_free_blocks(self) -> int:
        """How many blocks can be allocated now."""
        return self.slots.num_free

    def allocate_blocks(self, keys: Sequence[OffloadKey]) -> list[BlockStatus]:
        """Slots for writing `keys` (caller checked `get_num_free_blocks`). Each has `ref_cnt == -1`."""
        return BlockStatus.many(self.slots.allocate(len(keys)))

    def allocate_block_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        """The `block_id`s of `allocate_blocks(keys)`, without block objects where this backend
        does not extend `allocate_blocks` (a policy's batch calls, `CachePolicy.insert_written`)."""
        if type(self).allocate_blocks is Backend.allocate_blocks:
            return self.slots.allocate(len(keys))
        return list(map(_block_id, self.allocate_blocks(keys)))

    def free(self, block: BlockStatus) -> None:
        """Return a block's slot; call once per allocated block."""
        self.slots.release(block.block_id)

    def free_block_ids(self, block_ids: list[int]) -> None:
        """`free_many` for blocks given by their `block_id`s (a policy's `CachePolicy.evict_ids`);
        a backend that extends `free` or `free_many` gets `BlockStatus`es of those ids."""
        if type(self).free is Backend.free and type(self).free_many is Backend.free_many:
            self.slots.release_many(block_ids)
        else:
            self.free_many(BlockStatus.many(block_ids))

    def free_many(self, blocks: Iterable[BlockStatus]) -> None:
        """`free` for each block (one C-level pass unless a subclass extends `free`)."""
        if type(self).free is Backend.free:
            self.slots.release_many(map(_block_id, blocks))
            return
        free = self.free
        for block in blocks:
            free(block)

    def get_load_store_spec(self, keys: Iterable[OffloadKey], blocks: Iterable[BlockStatus]) -> BlockIDsLoadStoreSpec:
        """Where the given blocks live, for a handler to read or write them."""
        return self._spec(keys, list(map(_block_id, blocks)))

    def spec_for_ids(self, keys: Sequence[OffloadKey], block_ids: list[int]) -> BlockIDsLoadStoreSpec:
        """`get_load_store_spec` for blocks given by their `block_id`s (the block table's batch calls,
        `BlockTable.pin_loads`, make no block objects). A backend that overrides
        `get_load_store_spec` gets it called with `BlockStatus`es of those ids."""
        if type(self).get_load_store_spec is not Backend.get_load_store_spec:
            return self.get_load_store_spec(keys, BlockStatus.many(block_ids))
        return self._spec(keys, block_ids)

    def _spec(self, keys: Iterable[OffloadKey], block_ids: list[int]) -> BlockIDsLoadStoreSpec:
        spec_type = self.spec_type
        plain = _PLAIN_SPECS.get(spec_type)
        if plain is None:
            plain = _PLAIN_SPECS[spec_type] = (spec_type.__init__ is _PLAIN_INIT and getattr(
                spec_type.for_blocks, "__func__", None) is _PLAIN_FOR_BLOCKS)
        if plain:
            # A spec of slots only (CPU, memory): built without re-checking the slot numbers this
            # backend's allocator handed out (the request cycle builds one per call).
            spec = object.__new__(spec_type)
            spec.block_ids = block_ids
            spec.tier = self.name
            return spec
        return spec_type.for_blocks(block_ids, list(keys), tier=self.name)

    def still_valid(self, block: BlockStatus) -> bool:
        """After a failed read of `block`: is it still trustworthy? Backends that verify what
        they read (and forget what fails) say which blocks survived; the default is no, so a
        block that could not be read is dropped."""
        return False

    def recover(self) -> list[tuple[OffloadKey, BlockStatus]]:
        """Blocks that survive from an earlier process (ready, slots claimed). Default: none."""
        return []

    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract: most backends need it, some do not
        """Release memory, files and handles. Idempotent. Default: nothing to release."""


# The hops of a tier in host memory (`CPULoadStoreSpec`): copies between two host tiers and
# between a host tier and the engine's KV caches (`Backend.handlers`).
HOST_HANDLERS: tuple[tuple[type[LoadStoreSpec], type[LoadStoreSpec], str], ...] = (
    (CPULoadStoreSpec, CPULoadStoreSpec, "kvtier.transfer.handlers.memory:MemoryCopyHandler.for_backends"),
    (GPULoadStoreSpec, CPULoadStoreSpec, "kvtier.transfer.handlers.gpu_cpu:make_gpu_to_cpu"),
    (CPULoadStoreSpec, GPULoadStoreSpec, "kvtier.transfer.handlers.gpu_cpu:make_cpu_to_gpu"),
)


# ---------------------------------------------------------------------- capabilities
# What a backend offers beyond slot bookkeeping, declared by the methods it has. Handlers select
# the backends they can serve with `isinstance(backend, Capability)`, once, when they are built;
# a third-party backend gains a handler by offering the members, without naming these classes.


@runtime_checkable
class HostSlots(Protocol):
    """Slots in this process's memory: `view(slot)` is the slot's `block_bytes` bytes, writable,
    valid until `close` (MemoryBackend, CPUBackend). Served by the host-memory handlers
    (slot-to-slot copies, CPU <-> file)."""

    name: str
    num_blocks: int
    block_bytes: int

    def view(self, slot: int) -> memoryview: ...


@runtime_checkable
class HostRegion(HostSlots, Protocol):
    """`HostSlots` laid out as one region: `tensor()` is a uint8 torch tensor `(num_blocks,
    block_bytes)` without a copy, row `i` being slot `i`, rows `slot_stride` bytes apart
    (`slot_stride >= block_bytes`), its storage starting at slot 0 and spanning
    `num_blocks * slot_stride` bytes. Served by the engine <-> CPU handlers."""

    slot_stride: int

    def tensor(self) -> Any: ...


@runtime_checkable
class BlockFile(Protocol):
    """Slots in files, moved by whole blocks (FileBackend). `write_blocks` stores `buffers[i]`
    (`block_bytes`, C-contiguous) as block `keys[i]` in `slots[i]`; `read_blocks` reads and
    verifies them into the writable `buffers[i]`. Both return the bytes moved and raise on a
    failure. `num_threads` is how many of its I/Os the backend runs at once (handlers size their
    pools by it). Served by the CPU <-> file and engine <-> file handlers."""

    name: str
    block_bytes: int
    num_threads: int

    def write_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int: ...

    def read_blocks(self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence) -> int: ...


@runtime_checkable
class RemoteBlocks(Protocol):
    """Blocks on a server shared by several processes, addressed by key (ValkeyBackend); slots are local
    handles of keys known to be there. Byte API (handler threads): `put_blocks` stores `buffers[i]`
    (`block_bytes`) under `keys[i]` (what is not written by `deadline` is left unsent); `get_blocks`
    reads and verifies them into the writable `buffers[i]` by `deadline` (a `time.monotonic()` value,
    default `probe_timeout_s` from now); both return the bytes moved and raise on a failure (a key that
    is gone or fails verification, an unreachable server). `num_threads`: how many I/Os to run at once.

    Control API (scheduler thread; never blocks, never touches a socket): `request_probe(keys)`
    hands one batch to the backend's probe thread; `probe_results()` returns the batches answered
    since the last call (`has_probe_results` says whether there are any), `(keys, found)` with
    `found[i]` whether `keys[i]` is there, or None when the probe failed; `failed_keys()` the
    keys whose reads failed since the last call; `available`
    is False while the server is considered down (circuit breaker open); `accepts_writes()` False
    while recent writes were slow; `max_inflight_bytes` bounds the bytes of writes in flight;
    `probe_timeout_s` is how long a probe may take; `negative_ttl_s` how long an answer "absent"
    is trusted."""

    name: str
    block_bytes: int
    num_blocks: int
    num_threads: int
    max_inflight_bytes: int
    probe_timeout_s: float
    negative_ttl_s: float

    @property
    def available(self) -> bool: ...

    def put_blocks(self, keys: Sequence[bytes], buffers: Sequence, deadline: float | None = None) -> int: ...

    def get_blocks(self, keys: Sequence[bytes], buffers: Sequence, deadline: float | None = None) -> int: ...

    def request_probe(self, keys: Sequence[bytes]) -> None: ...

    def probe_results(self) -> list[tuple[list[bytes], list[bool] | None]]: ...

    @property
    def has_probe_results(self) -> bool: ...

    def failed_keys(self) -> list[bytes]: ...

    def accepts_writes(self) -> bool: ...
