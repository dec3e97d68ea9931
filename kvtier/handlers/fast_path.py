"""Which path a device's engine <-> CPU copies take, decided once per device per process.

A fast path (a `kvtier.handlers.cuda_copy.Submitter`: one DMA per page straight between the
engine and its CPU slot) is used only after it proved itself on that device: at first use it
copies a known pattern from a device buffer to scattered pages of pinned host memory and back,
and every byte must match (`check_round_trip`). The candidates are tried in order
(`cudaMemcpyBatchAsync` through ctypes, the same through cuda-bindings, then the compiled
`cudaMemcpyAsync` loop); the first that passes is kept. If any fails (an exception or a wrong
byte), ONE warning names the cause and what is used instead, for the rest of the process: the
next candidate, or (`None`) the staged path the handlers had before (device staging buffer and a
pinned bounce buffer). A wrong CUDA call may cost speed, never bytes: a fast path that fails a
job later (`demote_cuda`) is dropped the same way, with one warning, and that job is redone on
the staged path.

`KVTIER_GPU_COPY` (read when a handler is built and at the first decision) narrows the choice:
`auto` (default), `batch`, `bindings`, `loop`, or `staged` (no fast path: for comparisons and as
an escape hatch).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.handlers.copy_plan import CopyPlan
from kvtier.handlers.cuda_copy import (
    CopyError,
    Submitter,
    make_batch_submitter,
    make_c_batch_submitter,
    make_loop_submitter,
)

log = logging.getLogger(__name__)

PROBE_PAGE = 8192  # bytes per page of the self-check
PROBE_PAGES = 16
STAGED = "the staged path (device staging buffer, pinned bounce buffer, host row copies)"
Candidate = tuple[str, Callable[[], Submitter]]
CANDIDATES: dict[str, Candidate] = {
    "batch": ("cudaMemcpyBatchAsync", make_c_batch_submitter),
    "bindings": ("cudaMemcpyBatchAsync (cuda.bindings)", make_batch_submitter),
    "loop": ("cudaMemcpyAsync loop", make_loop_submitter),
}
MODES = ("auto", "batch", "bindings", "loop", "staged")


def candidates_for(mode: str) -> list[Candidate]:
    """The fast paths `KVTIER_GPU_COPY=mode` allows, best first; ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"KVTIER_GPU_COPY={mode!r} is not a copy path; use one of {', '.join(MODES)}")
    if mode == "auto":
        return [CANDIDATES["batch"], CANDIDATES["bindings"], CANDIDATES["loop"]]
    return [] if mode == "staged" else [CANDIDATES[mode]]


class FastPathChoice:
    """Per process: device key -> the submitter that passed its self-check there, or None."""

    def __init__(self) -> None:
        self._chosen: dict[Any, Submitter | None] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, candidates: Sequence[Candidate], check: Callable[[Submitter], None]) -> Submitter | None:
        """The decision for `key`, made on the first call (later calls return it unchanged)."""
        with self._lock:
            if key in self._chosen:
                return self._chosen[key]
            chosen, failures = None, []
            for name, make in candidates:
                try:
                    submitter = make()
                    check(submitter)
                except Exception as exc:  # noqa: BLE001 - any failure: not this path
                    failures.append(f"{name}: {type(exc).__name__}: {exc}")
                    continue
                chosen = submitter
                break
            self._chosen[key] = chosen
        using = chosen.name if chosen is not None else STAGED
        if failures:
            log.warning("engine<->CPU copies on %s: fast path failed its self-check (%s); using %s in this process",
                        key, "; ".join(failures), using)
        else:
            log.info("engine<->CPU copies on %s: %s", key, using if candidates else f"{using} (KVTIER_GPU_COPY)")
        return chosen

    def demote(self, key: Any, submitter: Submitter, why: str) -> None:
        """`submitter` failed a job on `key`: the staged path from now on (one WARNING, from the
        first handler that reports it)."""
        with self._lock:
            if self._chosen.get(key) is not submitter:
                return
            self._chosen[key] = None
        log.warning("engine<->CPU copies on %s: %s failed a job (%s); using %s in this process",
                    key, submitter.name, why, STAGED)

    def forget(self) -> None:
        """Drop every decision (tests)."""
        with self._lock:
            self._chosen.clear()


CHOICE = FastPathChoice()


def probe_plan(engine_base: int, host_base: int, to_host: bool) -> CopyPlan:
    """The self-check's plan: page `i` of the engine buffer <-> page `perm[i]` of the host one."""
    import numpy as np

    perm = np.random.default_rng(25).permutation(PROBE_PAGES).astype(np.int64)
    engine = engine_base + np.arange(PROBE_PAGES, dtype=np.int64) * PROBE_PAGE
    host = host_base + perm * PROBE_PAGE
    size = np.full(PROBE_PAGES, PROBE_PAGE, dtype=np.int64)
    return CopyPlan(engine, host, size) if to_host else CopyPlan(host, engine, size)


def check_round_trip(submitter: Submitter, engine, host, stream: int, synchronize: Callable[[], None]) -> None:
    """Copy a known pattern engine -> scattered host pages -> engine through `submitter` and
    verify both ways (`engine`, `host`: uint8 tensors of `PROBE_PAGE * PROBE_PAGES` bytes; ops on
    `engine` must be ordered with `stream`). CopyError naming the first wrong byte."""
    import torch

    n = PROBE_PAGE * PROBE_PAGES
    pattern = ((torch.arange(n, dtype=torch.int64) * 131 + 7) % 251).to(torch.uint8)
    perm = torch.from_numpy(probe_plan(0, 0, True).dst // PROBE_PAGE)
    engine.copy_(pattern)
    host.zero_()
    submitter.submit(probe_plan(engine.data_ptr(), host.data_ptr(), True), stream)
    synchronize()
    _compare("engine -> host", host.view(PROBE_PAGES, PROBE_PAGE)[perm].reshape(-1), pattern)
    engine.zero_()
    submitter.submit(probe_plan(engine.data_ptr(), host.data_ptr(), False), stream)
    synchronize()
    _compare("host -> engine", engine.cpu(), pattern)


def _compare(what: str, got, expected) -> None:
    import torch

    wrong = torch.nonzero(got.cpu() != expected)
    if len(wrong):
        at = int(wrong[0])
        raise CopyError(f"{what}: {len(wrong)} wrong byte(s), first at offset {at} "
                        f"(got {int(got[at])}, expected {int(expected[at])})")


def _key(device) -> str:
    import torch

    device = torch.device(device)
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def demote_cuda(device, submitter: Submitter, why: str) -> None:
    """A job on `device` failed in `submitter`: handlers that decide later get the staged path (a
    handler keeps its decision: the one whose job failed drops the path itself, another one at its
    own first failed job, which is then redone on the staged path)."""
    CHOICE.demote(_key(device), submitter, why)


def cuda_fast_path(device) -> Submitter | None:
    """The fast path for a CUDA `device`, self-checked on first use (module docstring)."""
    import torch

    key = _key(device)
    index = int(key.split(":")[1])

    def check(submitter: Submitter) -> None:
        with torch.cuda.device(index):
            stream = torch.cuda.Stream(device=index)
            engine = torch.empty(PROBE_PAGE * PROBE_PAGES, dtype=torch.uint8, device=index)
            host = torch.empty(PROBE_PAGE * PROBE_PAGES, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                check_round_trip(submitter, engine, host, stream.cuda_stream, stream.synchronize)

    return CHOICE.get(key, candidates_for(os.environ.get("KVTIER_GPU_COPY", "auto")), check)
