"""Argument checks of the standalone API (`kvtier.standalone.KVTier`): each bad argument is refused
with an `ArgumentError` (or `ArgumentTypeError`) that names it and says what would be valid."""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from typing import Any

from kvtier.core.errors import ArgumentError, ArgumentTypeError
from kvtier.core.keys import GROUP_BYTES
from kvtier.core.quoting import brief, suggest
from kvtier.core.types import CanonicalKVCaches


def check_kv_caches(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> None:
    """Refuse KV tensors the copies cannot use (every store would fail), naming the tensor or reference,
    and a `blocks_per_chunk` that is not a positive int."""
    if type(blocks_per_chunk) is not int or blocks_per_chunk < 1:
        error = ArgumentError if type(blocks_per_chunk) is int else ArgumentTypeError
        raise error(f"blocks_per_chunk: {short(blocks_per_chunk)}; the number of engine blocks one key "
                    "covers, an int >= 1")
    tensors = list(getattr(kv_caches, "tensors", None) or [])
    if not tensors:
        raise ArgumentError("kv_caches.tensors: no KV tensors; give at least one CanonicalKVCacheTensor")
    pages = [check_kv_tensor(entry, f"kv_caches.tensors[{i}]", tensors[0]) for i, entry in enumerate(tensors)]
    for g, refs in enumerate(kv_caches.group_data_refs or []):
        if not refs:
            raise ArgumentError(f"kv_caches.group_data_refs[{g}]: empty; each KV-cache group needs at least "
                                "one CanonicalKVCacheRef (the pages a block of that group holds)")
        for r, ref in enumerate(refs):
            name = f"kv_caches.group_data_refs[{g}][{r}]"
            for field in ("tensor_idx", "page_size_bytes"):
                value = getattr(ref, field, None)
                if type(value) is not int:
                    raise ArgumentTypeError(f"{name}.{field}: {type(value).__name__} {short(value)}; an int")
            if not 0 <= ref.tensor_idx < len(tensors):
                raise ArgumentError(f"{name}.tensor_idx: {ref.tensor_idx} names no tensor (0..{len(tensors) - 1})")
            if not 0 < ref.page_size_bytes <= pages[ref.tensor_idx]:
                raise ArgumentError(f"{name}.page_size_bytes: {ref.page_size_bytes} is not within the "
                                    f"{pages[ref.tensor_idx]}-byte page of tensor {ref.tensor_idx}")


def check_kv_tensor(entry: Any, name: str, first: Any) -> int:
    """Check one `CanonicalKVCacheTensor`: a tensor whose dim 0 is the block and whose blocks are
    contiguous runs of at least `page_size_bytes` bytes, on the first tensor's device. Returns the page."""
    from kvtier.transfer.handlers.gpu_cpu import byte_rows

    t: Any = getattr(entry, "tensor", None)  # checked below: a torch tensor (None fails the check)
    page = getattr(entry, "page_size_bytes", None)
    if not callable(getattr(t, "element_size", None)) or not callable(getattr(t, "stride", None)):
        raise ArgumentTypeError(f"{name}.tensor: {type(t).__name__}, not a torch tensor")
    if type(page) is not int or page < 1:
        raise ArgumentError(f"{name}.page_size_bytes: {short(page)}; a positive number of bytes")
    if t.dim() < 1 or t.device != first.tensor.device:
        raise ArgumentError(f"{name}: a {t.dim()}-D tensor on {t.device}; KV tensors have a block dimension "
                            f"first and live on one device ({first.tensor.device})")
    if t.device.type not in ("cpu", "cuda"):
        raise ArgumentError(f"{name}: on device {t.device}; kvtier copies KV caches on cpu or cuda "
                            "(a meta tensor has no bytes to copy)")
    if t.shape[0] < 1:
        raise ArgumentError(f"{name}: no blocks (shape {tuple(t.shape)}); dim 0 is the engine's blocks")
    expected = 1  # the stride each inner dimension has when one block is one contiguous run
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            raise ArgumentError(f"{name}: a block is not contiguous (shape {tuple(t.shape)}, strides "
                                f"{t.stride()}); the engine's KV cache itself must have contiguous blocks "
                                "(t[i].is_contiguous()): a contiguous copy would not be the cache")
        expected *= size
    block_bytes = expected * t.element_size()
    if page > block_bytes:
        raise ArgumentError(f"{name}.page_size_bytes: {page} is more than the {block_bytes} bytes of one block "
                            f"of a tensor of shape {tuple(t.shape)} and dtype {t.dtype}")
    try:
        byte_rows(t, page)  # what every copy will do
    except (ValueError, RuntimeError) as exc:
        raise ArgumentError(f"{name}: cannot be read as blocks of {page} bytes ({exc})") from None
    return page


def as_list(values: Iterable[Any], name: str, example: str) -> list[Any]:
    """`values` as a new list; a lone bytes/str (say a key where a sequence of keys belongs) is refused."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise ArgumentTypeError(f"{name}: a single {type(values).__name__}, not a sequence; pass a list, "
                                f"e.g. {example}")
    try:
        return list(values)
    except TypeError:
        raise ArgumentTypeError(f"{name}: {type(values).__name__} is not a sequence; pass a list, "
                                f"e.g. {example}") from None


def as_key(key: Any, i: int) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise ArgumentTypeError(f"keys[{i}]: {type(key).__name__} {short(key)} is not a key; keys are bytes "
                            f"(a block hash plus a {GROUP_BYTES}-byte group index, kvtier.make_offload_key)")


def as_ids(engine_block_ids: Any) -> list[int]:
    """Engine block ids as a list of ints: a sequence of ints, or a 1-D integer numpy array or tensor."""
    ndim = getattr(engine_block_ids, "ndim", None)
    if ndim is not None and hasattr(engine_block_ids, "tolist"):  # numpy array or torch tensor
        if ndim != 1:
            raise ArgumentTypeError(f"engine_block_ids: a {ndim}-D array of shape "
                                    f"{tuple(engine_block_ids.shape)}; pass a 1-D sequence of ints")
        engine_block_ids = engine_block_ids.tolist()
    ids = as_list(engine_block_ids, "engine_block_ids", "[3, 7]")
    if set(map(type, ids)) - {int}:
        ids = [as_id(b, i) for i, b in enumerate(ids)]
    return ids


def as_id(block: Any, i: int) -> int:
    """One engine block id as an int: any integer (numpy's too) but a bool; never a float."""
    if type(block) is int:
        return block
    if not isinstance(block, bool) and "bool" not in str(getattr(block, "dtype", "")):
        try:
            return operator.index(block)
        except TypeError:
            pass
    raise ArgumentTypeError(f"engine_block_ids[{i}]: {type(block).__name__} {short(block)} is not an engine "
                            "block id; ids are ints")


BUILD_OPTIONS = ("enable_events",)  # `KVTier.open`'s `**build_options` (for `build_hierarchy`)


def check_open_args(config: Any, model: Any, build_options: dict[str, Any]) -> None:
    """Refuse `KVTier.open`'s `config` of a type it cannot read, a `model` that is no string, and
    an option `build_hierarchy` does not take, naming each."""
    if not isinstance(config, (str, os.PathLike)) and not hasattr(config, "tiers"):
        raise ArgumentTypeError(f"config: {type(config).__name__} {short(config)}; a path to a YAML file, or a "
                                "HierarchyConfig (kvtier.load_config_text(text))")
    if not isinstance(model, str):
        raise ArgumentTypeError(f"model: {type(model).__name__} {short(model)}; a string naming the model, "
                                "e.g. 'meta-llama/Llama-3.1-8B@<revision>' ('' when no other engine shares the tiers)")
    for option in build_options:
        if option not in BUILD_OPTIONS:
            raise ArgumentTypeError(f"{option}: not an option of KVTier.open{suggest(option, OPEN_OPTIONS)}; it takes "
                                    f"{', '.join(OPEN_OPTIONS)}")


OPEN_OPTIONS = ("blocks_per_chunk", "model", "metrics_port", "metrics_addr", *BUILD_OPTIONS)


def as_timeout(value: Any, name: str) -> float | None:
    """`value` as a number of seconds >= 0 (inf or None: no limit); refused naming `name`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name}: {type(value).__name__} {short(value)}; a number of seconds >= 0 "
                                "(None: no limit)")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = float("nan")
    if not seconds >= 0:  # (NaN too)
        raise ArgumentError(f"{name}: {short(value)}; a number of seconds >= 0 (None: no limit)")
    return seconds


def raise_duplicate(values: list[Any], name: str, why: str) -> None:
    first: dict[Any, int] = {}
    for i, value in enumerate(values):
        j = first.setdefault(value, i)
        if j != i:
            raise ArgumentError(f"{name}[{i}]: {short(value)} repeats {name}[{j}]; {why}")


def short(value: Any, limit: int = 40) -> str:
    """`repr(value)` (bytes in hex), cut to `limit` characters: a hostile value can be huge."""
    if isinstance(value, bytes):
        text = f"key {value[:limit // 2 + 1].hex()}"
    elif isinstance(value, (str, bytearray)):
        text = repr(value[:limit + 1])
    else:
        text = brief(value, limit + 1)  # (a 5,000-digit int has no repr)
    return text if len(text) <= limit else text[:limit] + "..."
