"""The CUDA copy layer's device-agnostic parts on CPU: the compiled `cudaMemcpyAsync` loop driven by
a ctypes stand-in, and the fast path's self-check and one-time decision with fake submitters.
The real CUDA submitters are exercised by the `gpu` tests at the end."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest

from kvtier.transfer.handlers import fast_path
from kvtier.transfer.handlers.copy_plan import CopyPlan
from kvtier.transfer.handlers.cuda_copy import (
    CUDA_MEMCPY_DEFAULT,
    SRC_ACCESS_ORDER_STREAM,
    CBatchSubmitter,
    CopyError,
    LoopSubmitter,
    batch_prototype,
)

torch = pytest.importorskip("torch")

MEMCPY_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p)


class FakeMemcpyAsync:
    """A C function with cudaMemcpyAsync's signature that memmoves and records its calls;
    it returns `error` from call number `fail_at` on."""

    def __init__(self, fail_at: int | None = None, error: int = 1):
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.fail_at, self.error = fail_at, error
        self.function = MEMCPY_ASYNC(self._call)  # kept alive with this object

    def _call(self, dst, src, count, kind, stream):
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            return self.error
        self.calls.append((dst, src, count, kind, stream or 0))
        ctypes.memmove(dst, src, count)
        return 0

    @property
    def address(self) -> int:
        return ctypes.cast(self.function, ctypes.c_void_p).value


def scattered_plan(src, dst, page: int, order):
    """Page i of `src` -> page order[i] of `dst` (uint8 tensors)."""
    n = len(order)
    return CopyPlan(src.data_ptr() + np.arange(n, dtype=np.int64) * page,
                    dst.data_ptr() + np.asarray(order, dtype=np.int64) * page, np.full(n, page, dtype=np.int64))


def test_the_compiled_loop_submits_every_descriptor_in_order():
    fake = FakeMemcpyAsync()
    src = torch.randint(0, 256, (10 * 64,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    order = [3, 9, 0, 5, 1, 7, 2, 8, 4, 6]
    plan = scattered_plan(src, dst, 64, order)
    LoopSubmitter(fake.address).submit(plan, stream=0xBEEF)
    assert torch.equal(dst.view(10, 64)[order], src.view(10, 64))
    assert [c[:3] for c in fake.calls] == list(zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist()))
    assert {c[3] for c in fake.calls} == {CUDA_MEMCPY_DEFAULT} and {c[4] for c in fake.calls} == {0xBEEF}


def test_an_error_code_stops_the_loop_and_names_the_descriptor():
    fake = FakeMemcpyAsync(fail_at=4, error=700)
    src = torch.randint(1, 256, (10 * 64,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    plan = scattered_plan(src, dst, 64, range(10))
    with pytest.raises(CopyError, match="cudaMemcpyAsync returned error 700 at descriptor 4 of 10"):
        LoopSubmitter(fake.address).submit(plan, stream=0)
    assert len(fake.calls) == 4
    assert torch.equal(dst[:4 * 64], src[:4 * 64]) and int(dst[4 * 64:].sum()) == 0  # none after it


def test_the_loop_refuses_mismatched_arrays_and_a_null_function():
    plan = CopyPlan(np.zeros(2, dtype=np.int64), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        LoopSubmitter(FakeMemcpyAsync().address).submit(plan, 0)
    with pytest.raises(ValueError, match="null cudaMemcpyAsync"):
        LoopSubmitter(0).submit(CopyPlan(*(np.zeros(1, dtype=np.int64),) * 3), 0)


class FakeBatch:
    """A C function with cudaMemcpyBatchAsync's prototype (CUDA 12.8/12.9 with failIdx, or 13)
    that checks the one attribute and memmoves every descriptor, or fails at descriptor `fail_at`."""

    def __init__(self, with_fail_index: bool, fail_at: int | None = None):
        self.with_fail_index, self.fail_at, self.calls = with_fail_index, fail_at, []
        self.function = batch_prototype(with_fail_index)(self._call)

    def _call(self, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, *rest):
        self.calls.append((count, num_attrs, rest[-1]))
        order = ctypes.c_uint32.from_address(attrs).value
        if num_attrs != 1 or ctypes.c_size_t.from_address(attr_idxs).value != 0 or order != SRC_ACCESS_ORDER_STREAM:
            return 1  # cudaErrorInvalidValue
        arrays = [(ctypes.c_int64 * count).from_address(a) for a in (dsts, srcs, sizes)]
        for i, (d, s, n) in enumerate(zip(*arrays)):
            if i == self.fail_at:
                if self.with_fail_index:
                    ctypes.c_size_t.from_address(rest[0]).value = i
                return 1
            ctypes.memmove(d, s, n)
        return 0


@pytest.mark.parametrize("with_fail_index", [True, False], ids=["cuda12.8", "cuda13"])
def test_one_batch_call_moves_every_descriptor(with_fail_index):
    fake = FakeBatch(with_fail_index)
    src = torch.randint(0, 256, (12 * 32,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    order = [11, 4, 0, 7, 2, 9, 1, 10, 3, 8, 5, 6]
    CBatchSubmitter(fake.function, with_fail_index).submit(scattered_plan(src, dst, 32, order), stream=0x5EED)
    assert torch.equal(dst.view(12, 32)[order], src.view(12, 32))
    assert fake.calls == [(12, 1, 0x5EED)]  # one call, one attribute, the handler's stream
    CBatchSubmitter(fake.function, with_fail_index).submit(CopyPlan(*(np.zeros(0, dtype=np.int64),) * 3), 1)
    assert len(fake.calls) == 1  # an empty plan calls nothing


@pytest.mark.parametrize("with_fail_index", [True, False], ids=["cuda12.8", "cuda13"])
def test_a_failing_batch_call_raises_with_the_index_where_cuda_gives_it(with_fail_index):
    fake = FakeBatch(with_fail_index, fail_at=3)
    src = torch.randint(0, 256, (6 * 32,), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # alive while the plan's addresses are written
    expected = "returned error 1 at descriptor 3$" if with_fail_index else "returned error 1$"
    with pytest.raises(CopyError, match=expected):
        CBatchSubmitter(fake.function, with_fail_index).submit(scattered_plan(src, dst, 32, range(6)), stream=7)
    assert torch.equal(dst[:3 * 32], src[:3 * 32]) and int(dst[3 * 32:].sum()) == 0


class FakeCudart:
    """Stands for a loaded libcudart: a runtime version and cudaMemcpyBatchAsync stand-ins of
    both prototypes (the one the version calls for is the one that works)."""

    def __init__(self, version: int):
        self.version = version
        self.batches = {True: FakeBatch(True), False: FakeBatch(False)}
        self.cudaMemcpyBatchAsync = self.batches[version < 13000].function

    def cudaRuntimeGetVersion(self, out) -> int:
        out._obj.value = self.version
        return 0


@pytest.mark.parametrize("version,fail_index", [(12080, True), (12090, True), (13000, False), (13020, False)])
def test_the_batch_prototype_follows_the_runtime_version(monkeypatch, version, fail_index):
    from kvtier.transfer.handlers import cuda_copy

    fake = FakeCudart(version)
    monkeypatch.setattr(cuda_copy, "loaded_cudart", lambda: fake)
    submitter = cuda_copy.make_c_batch_submitter()
    assert submitter.with_fail_index is fail_index
    src = torch.randint(0, 256, (4 * 16,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    submitter.submit(scattered_plan(src, dst, 16, [2, 0, 3, 1]), stream=9)
    assert torch.equal(dst.view(4, 16)[[2, 0, 3, 1]], src.view(4, 16))
    assert fake.batches[fail_index].calls == [(4, 1, 9)]


def test_a_runtime_older_than_12_8_has_no_batch_path(monkeypatch):
    from kvtier.transfer.handlers import cuda_copy

    monkeypatch.setattr(cuda_copy, "loaded_cudart", lambda: FakeCudart(12040))
    with pytest.raises(CopyError, match=r"CUDA runtime 12.4 has no cudaMemcpyBatchAsync \(needs 12.8\)"):
        cuda_copy.make_c_batch_submitter()


class FakeBindingsRuntime:
    """Stands for `cuda.bindings.runtime` (12.8/12.9): cudaMemcpyBatchAsync answers `(err, failIdx)`."""

    class cudaError_t:  # the binding's names
        cudaSuccess = 0

    class cudaMemcpySrcAccessOrder:
        cudaMemcpySrcAccessOrderStream = SRC_ACCESS_ORDER_STREAM

    class cudaMemcpyAttributes:
        srcAccessOrder = 0

    def __init__(self, answer: tuple):
        self.answer = answer

    def cudaMemcpyBatchAsync(self, *args):
        return self.answer


@pytest.mark.parametrize("fail_index,where", [(2, " at descriptor 2"), ((1 << 64) - 1, "")],
                         ids=["descriptor", "SIZE_MAX"])
def test_the_bindings_path_names_a_descriptor_only_where_cuda_gives_one(fail_index, where):
    """CUDA sets failIdx to SIZE_MAX for an error that concerns no particular descriptor."""
    from kvtier.transfer.handlers.cuda_copy import BatchSubmitter

    plan = CopyPlan(*(np.arange(4, dtype=np.int64),) * 3)
    with pytest.raises(CopyError, match=rf"^cudaMemcpyBatchAsync of 4 descriptors returned 1{where}$"):
        BatchSubmitter(FakeBindingsRuntime((1, fail_index))).submit(plan, 7)


class Memmove:
    """A fake submitter that executes plans with memmove (what a correct CUDA path does)."""

    name = "memmove"

    def __init__(self):
        self.plans = 0

    def submit(self, plan: CopyPlan, stream: int) -> None:
        self.plans += 1
        for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.size.tolist()):
            ctypes.memmove(d, s, n)


class Corrupting(Memmove):
    """Copies, then flips one byte of the last destination page."""

    name = "corrupting"

    def submit(self, plan: CopyPlan, stream: int) -> None:
        super().submit(plan, stream)
        byte = ctypes.c_uint8.from_address(int(plan.dst[-1]) + 5)
        byte.value ^= 0x40


class Raising(Memmove):
    name = "raising"

    def submit(self, plan: CopyPlan, stream: int) -> None:
        raise CopyError("cudaMemcpyBatchAsync returned cudaErrorInvalidValue")


def host_check(submitter) -> None:
    n = fast_path.PROBE_PAGE * fast_path.PROBE_PAGES
    fast_path.check_round_trip(submitter, torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8),
                               0, lambda: None)


def test_the_self_check_passes_a_correct_path_and_names_a_wrong_byte():
    good = Memmove()
    host_check(good)
    assert good.plans == 2  # both directions
    with pytest.raises(CopyError, match=r"engine -> host: 1 wrong byte\(s\)"):
        host_check(Corrupting())


def test_a_failing_fast_path_warns_once_and_the_next_path_is_used_for_good(caplog):
    choice, made = fast_path.FastPathChoice(), []

    def maker(cls):
        def make():
            made.append(cls.name)
            return cls()
        return make

    candidates = [("batch", maker(Raising)), ("corrupt", maker(Corrupting)), ("loop", maker(Memmove))]
    with caplog.at_level(logging.INFO, logger="kvtier.transfer.handlers.fast_path"):
        chosen = choice.get("cuda:0", candidates, host_check)
        again = choice.get("cuda:0", candidates, host_check)
    assert chosen is again and isinstance(chosen, Memmove) and type(chosen) is Memmove
    assert made == ["raising", "corrupting", "memmove"]  # decided once: no second self-check
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "cudaErrorInvalidValue" in text and "wrong byte" in text and "using memmove" in text


def test_no_working_fast_path_means_the_staged_path_with_one_warning(caplog):
    choice = fast_path.FastPathChoice()
    broken = [("batch", Raising), ("loop", Corrupting)]
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
        assert choice.get("cuda:1", broken, host_check) is None
        assert choice.get("cuda:1", broken, host_check) is None
    assert len(caplog.records) == 1 and "staged path" in caplog.records[0].getMessage()
    assert choice.get("cuda:2", [("loop", Memmove)], host_check) is not None  # per device


def test_a_path_that_fails_a_job_is_dropped_with_one_warning(caplog):
    choice = fast_path.FastPathChoice()
    good = choice.get("cuda:0", [("memmove", Memmove)], host_check)
    with caplog.at_level(logging.WARNING, logger="kvtier.transfer.handlers.fast_path"):
        choice.demote("cuda:0", good, "error 700")
        choice.demote("cuda:0", good, "error 700")  # the other handler of the device, later
        choice.demote("cuda:1", Memmove(), "not that device's path")
    assert choice.get("cuda:0", [("memmove", Memmove)], host_check) is None
    assert len(caplog.records) == 1 and "memmove failed a job (error 700)" in caplog.records[0].getMessage()


def test_copy_modes():
    assert [name for name, _ in fast_path.candidates_for("auto")] == [
        "cudaMemcpyBatchAsync", "cudaMemcpyBatchAsync (cuda.bindings)", "cudaMemcpyAsync loop", "Triton copy kernel"]
    assert fast_path.candidates_for("staged") == []
    with pytest.raises(ValueError, match="KVTIER_GPU_COPY='fast' is not a copy path; use one of auto, batch"):
        fast_path.candidates_for("fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["batch", "bindings", "loop", "kernel"])
def test_each_cuda_submitter_passes_the_self_check(mode):
    name, make = fast_path.candidates_for(mode)[0]
    submitter = make()
    with torch.cuda.device(0):
        stream = torch.cuda.Stream()
        n = fast_path.PROBE_PAGE * fast_path.PROBE_PAGES
        engine = torch.empty(n, dtype=torch.uint8, device="cuda")
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            fast_path.check_round_trip(submitter, engine, host, stream.cuda_stream, stream.synchronize)
    fast_path.CHOICE.forget()
    assert fast_path.cuda_fast_path("cuda:0") is not None
