"""Which path a device's engine <-> CPU copies take, decided once per device and layout per process.

A fast path (a `kvtier.transfer.handlers.cuda_copy.Submitter`: one DMA per page straight between the
engine and its CPU slot) is used only after it proved itself on that device: at first use it
copies a known pattern from a device buffer to scattered pages of pinned host memory and back,
and every byte must match (`check_round_trip`). Every candidate (`cudaMemcpyBatchAsync` through
ctypes, the same through cuda-bindings, the compiled `cudaMemcpyAsync` loop, a Triton copy kernel
over the region's device mapping: `kvtier.transfer.handlers.copy_kernel`) is self-checked,
then each that passed is timed on a probe of the layout's pages (`kvtier.transfer.handlers.copy_timing`:
about one job each way, a few milliseconds), and the fastest is taken (the earlier one when two
are within 3 %): no mechanism wins everywhere, and which one wins depends on the device, the
driver and the page size. The decision, each candidate's figures and why any was left out go to
the log once (INFO; WARNING when one failed), and `decisions()` keeps them (`kvtier config check
--env`, the benchmarks). A candidate that raises or gets a byte wrong is never chosen; if none is
left, ONE warning names the causes and the staged path the handlers had before (device staging
buffer and a pinned bounce buffer) is used. A wrong CUDA call may cost speed, never bytes: a fast
path that fails a job later (`demote_cuda`) is dropped the same way, with one warning, and that
job is redone on the staged path.

`KVTIER_GPU_COPY` (read when a handler is built and at the first decision) narrows the choice:
`auto` (default), `batch`, `bindings`, `loop`, `kernel`, or `staged` (no fast path: for
comparisons and as an escape hatch). A candidate that does not exist here (`Unavailable`: a
runtime older than 12.8, no cuda-bindings, no Triton) is named in the INFO line, not warned about.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.transfer.handlers.copy_plan import CopyPlan
from kvtier.transfer.handlers.copy_timing import Timing, pick, probe_sizes, time_mechanism
from kvtier.transfer.handlers.cuda_copy import (
    CopyError,
    Submitter,
    Unavailable,
    make_batch_submitter,
    make_c_batch_submitter,
    make_loop_submitter,
)

log = logging.getLogger(__name__)

PROBE_PAGE = 8192  # bytes per page of the self-check
PROBE_PAGES = 16
STAGED = "the staged path (device staging buffer, pinned bounce buffer, host row copies)"
Candidate = tuple[str, Callable[[], Submitter]]


def make_kernel_submitter() -> Submitter:
    """The Triton copy kernel (`kvtier.transfer.handlers.copy_kernel`; `Unavailable` without Triton)."""
    from kvtier.transfer.handlers.copy_kernel import make_kernel_submitter as make

    return make()


CANDIDATES: dict[str, Candidate] = {
    "batch": ("cudaMemcpyBatchAsync", make_c_batch_submitter),
    "bindings": ("cudaMemcpyBatchAsync (cuda.bindings)", make_batch_submitter),
    "loop": ("cudaMemcpyAsync loop", make_loop_submitter),
    "kernel": ("Triton copy kernel", make_kernel_submitter),
}
MODES = ("auto", "batch", "bindings", "loop", "kernel", "staged")


def candidates_for(mode: str) -> list[Candidate]:
    """The fast paths `KVTIER_GPU_COPY=mode` allows, best first; ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"KVTIER_GPU_COPY={mode!r} is not a copy path; use one of {', '.join(MODES)}")
    if mode == "auto":
        return [CANDIDATES["batch"], CANDIDATES["bindings"], CANDIDATES["loop"], CANDIDATES["kernel"]]
    return [] if mode == "staged" else [CANDIDATES[mode]]


@dataclass
class Decision:
    """What was chosen for one device and layout, each timed candidate's figures (in order of
    preference) and why the others were left out."""

    chosen: Submitter | None
    timings: list[tuple[str, Timing]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)  # mechanisms that do not exist here (no failure)

    def describe(self) -> str:
        using = self.chosen.name if self.chosen is not None else STAGED
        figures = "; ".join(f"{name}: {t.brief()}" for name, t in self.timings)
        notes = [f"measured here: {figures}"] if figures else []
        notes += ["not available here: " + "; ".join(self.unavailable)] if self.unavailable else []
        return using + (f" ({'; '.join(notes)})" if notes else "")


class FastPathChoice:
    """Per process: key (device, layout pages) -> the `Decision` made there at first use."""

    def __init__(self) -> None:
        self._decisions: dict[Any, Decision] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, candidates: Sequence[Candidate], check: Callable[[Submitter], None],
            timer: Callable[[Submitter], Timing] | None = None) -> Submitter | None:
        """The decision for `key`, made on the first call (later calls return it unchanged): each
        candidate made and self-checked (`check`), each that passed timed (`timer`, if given), the
        fastest taken (`copy_timing.pick`); without a timer, the first that passed."""
        with self._lock:
            if key in self._decisions:
                return self._decisions[key].chosen
            passed, decision = [], Decision(None)
            for name, make in candidates:
                try:
                    submitter = make()
                except (Unavailable, ImportError) as exc:  # nothing to try here: not a failure
                    decision.unavailable.append(f"{name}: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 - any failure: not this path
                    decision.failures.append(f"{name}: {type(exc).__name__}: {exc}")
                    continue
                try:
                    check(submitter)
                except Exception as exc:  # noqa: BLE001 - any failure: not this path
                    decision.failures.append(f"{name}: {type(exc).__name__}: {exc}")
                    continue
                passed.append(submitter)
            decision.chosen = self._fastest(passed, timer, decision) if timer is not None else next(iter(passed), None)
            self._decisions[key] = decision
        self._log(key, decision, bool(candidates))
        return decision.chosen

    @staticmethod
    def _fastest(passed: list[Submitter], timer: Callable[[Submitter], Timing], decision: Decision) -> Any:
        timed = []
        for submitter in passed:
            try:
                timed.append((submitter, timer(submitter)))
            except Exception as exc:  # noqa: BLE001 - a mechanism that fails its timing is not used
                decision.failures.append(f"{submitter.name}: {type(exc).__name__} while timed: {exc}")
        decision.timings = [(submitter.name, timing) for submitter, timing in timed]
        return pick(timed)

    @staticmethod
    def _log(key: Any, decision: Decision, any_allowed: bool) -> None:
        if decision.failures:
            log.warning("engine<->CPU copies on %s: left out (%s); using %s in this process", key,
                        "; ".join(decision.failures), decision.describe())
        else:
            log.info("engine<->CPU copies on %s: %s", key,
                     decision.describe() if any_allowed else f"{STAGED} (KVTIER_GPU_COPY)")

    def decisions(self) -> dict[Any, Decision]:
        """Every decision made in this process so far."""
        with self._lock:
            return dict(self._decisions)

    def demote(self, key: Any, submitter: Submitter, why: str) -> None:
        """`submitter` failed a job on `key`: the staged path from now on (one WARNING, from the
        first handler that reports it)."""
        with self._lock:
            decision = self._decisions.get(key)
            if decision is None or decision.chosen is not submitter:
                return
            decision.chosen = None
            decision.failures.append(f"{submitter.name} failed a job ({why})")
        log.warning("engine<->CPU copies on %s: %s failed a job (%s); using %s in this process",
                    key, submitter.name, why, STAGED)

    def forget(self) -> None:
        """Drop every decision (tests)."""
        with self._lock:
            self._decisions.clear()


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
    device_key = _key(device)
    for key in CHOICE.decisions():
        if isinstance(key, tuple) and key[0] == device_key:
            CHOICE.demote(key, submitter, why)


def cuda_fast_path(device, pages: Sequence[int] = (PROBE_PAGE,)) -> Submitter | None:
    """The fast path for a CUDA `device` and a layout whose blocks have `pages` (bytes of each
    reference), self-checked and timed on first use (module docstring)."""
    import torch

    device_key = _key(device)
    index = int(device_key.split(":")[1])
    buffers: dict[str, Any] = {}

    def check(submitter: Submitter) -> None:
        with torch.cuda.device(index):
            stream = torch.cuda.Stream(device=index)
            engine = torch.empty(PROBE_PAGE * PROBE_PAGES, dtype=torch.uint8, device=index)
            host = torch.empty(PROBE_PAGE * PROBE_PAGES, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                check_round_trip(submitter, engine, host, stream.cuda_stream, stream.synchronize)

    def timer(submitter: Submitter) -> Timing:
        with torch.cuda.device(index):
            if not buffers:  # made once, for every candidate
                engine_bytes, host_bytes = probe_sizes(pages)
                buffers.update(stream=torch.cuda.Stream(device=index),
                               engine=torch.empty(engine_bytes, dtype=torch.uint8, device=index),
                               host=torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True))
            stream = buffers["stream"]
            with torch.cuda.stream(stream):
                return time_mechanism(submitter, pages, buffers["engine"].data_ptr(), buffers["host"].data_ptr(),
                                      stream.cuda_stream, stream.synchronize)

    key = (device_key, tuple(sorted(pages)))
    try:
        return CHOICE.get(key, candidates_for(os.environ.get("KVTIER_GPU_COPY", "auto")), check, timer)
    finally:
        buffers.clear()


CHECK_PAGES = (64 << 10, 256 << 10, 2 << 20)


def engine_cpu_note(options: Any, pages: Sequence[int] = CHECK_PAGES, gpu: bool | None = None) -> str:
    """For `kvtier config check --env`, a CPU tier with `options`: which copy mechanism the
    engine <-> CPU handlers take on this machine's first GPU, with the figures it was chosen by,
    for blocks of one reference of each of `pages` bytes (measured now: a few milliseconds each).
    Nothing is imported or measured where no NVIDIA GPU is visible (`gpu` None: device nodes)."""
    from kvtier.tiers.file import fileio

    if not (fileio.gpu_present() if gpu is None else gpu):
        return "engine<->CPU: no NVIDIA GPU visible here, no copy mechanism to choose (host row copies)"
    if str(options.get("pin", "auto")) == "false":
        return f"engine<->CPU: {STAGED} (pin: false: a fast path needs a pinned region)"
    try:
        import torch

        if not torch.cuda.is_available():
            return "engine<->CPU: torch sees no CUDA device, no copy mechanism to choose"
        parts = []
        for page in pages:
            cuda_fast_path("cuda:0", (page,))
            parts.append(f"{page >> 10} KiB pages: {CHOICE.decisions()[('cuda:0', (page,))].describe()}")
    except Exception as exc:  # noqa: BLE001 - a check reports, it does not stop
        return f"engine<->CPU: the copy mechanism could not be measured here ({type(exc).__name__}: {exc})"
    return "engine<->CPU copies on cuda:0: " + "; ".join(parts)
