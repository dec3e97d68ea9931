"""How fast each copy mechanism is on this device and layout: the measurement `fast_path` chooses by.

Every mechanism that passed the self-check moves a probe of the layout's shape both ways:
`blocks` engine blocks, each of the layout's pages (one descriptor per page, as tensors per layer
give), to and from slots of a pinned host buffer in a random order, each slot with a 4 KiB header
before its pages (so no two descriptors merge, as in the CPU tier). The probe is about one job
(`PROBE_BYTES`, 16 MiB by default: 256 blocks of 64 KiB, 8 of 2 MiB), submitted and waited for
`repeats` times after one warm-up; a direction's figure is the best wall time from the
submission to the end of the stream, host submission included (a mechanism that is slow to
submit is slow). The score is the sum of both directions' seconds; `pick` takes the fastest,
preferring the earlier candidate when the two are within `MARGIN` (noise must not flip a choice).

Nothing here needs CUDA: `time_mechanism` takes the buffers, a stream handle and a synchronize
function, so the tests drive it on host memory with stand-in mechanisms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.transfer.handlers.copy_plan import CopyPlan

PROBE_BYTES = 16 << 20
MAX_PROBE_BLOCKS = 1024  # small pages: at most this many blocks (descriptors = blocks x pages)
SLOT_HEADER = 4096
MARGIN = 0.03  # a later candidate is taken only when it is more than 3 % faster


@dataclass(frozen=True)
class Timing:
    """One mechanism's probe: `nbytes` each way in `d2h_s` (engine -> host) and `h2d_s` seconds."""

    nbytes: int
    d2h_s: float
    h2d_s: float

    @property
    def seconds(self) -> float:
        return self.d2h_s + self.h2d_s

    def brief(self) -> str:
        return f"D2H {self.nbytes / self.d2h_s / 1e9:.1f} GB/s, H2D {self.nbytes / self.h2d_s / 1e9:.1f} GB/s"

    def as_dict(self) -> dict:
        return {"bytes": self.nbytes, "d2h_gbps": self.nbytes / self.d2h_s / 1e9,
                "h2d_gbps": self.nbytes / self.h2d_s / 1e9}


def probe_blocks(pages: Sequence[int]) -> int:
    """Blocks of the probe for a layout whose block has `pages` (bytes of each reference)."""
    return max(1, min(MAX_PROBE_BLOCKS, PROBE_BYTES // max(1, sum(pages))))


def probe_sizes(pages: Sequence[int]) -> tuple[int, int]:
    """(engine buffer bytes, host buffer bytes) the probe of `pages` needs."""
    blocks, block = probe_blocks(pages), sum(pages)
    return blocks * block, blocks * (block + SLOT_HEADER)


def probe_plans(pages: Sequence[int], engine_base: int, host_base: int) -> tuple[CopyPlan, CopyPlan]:
    """(engine -> host, host -> engine) plans of the probe: page `j` of block `b` lies at
    `engine_base + offset_j * blocks + b * pages[j]` (one tensor per page, as per layer) and goes
    to slot `perm[b]` of the host buffer, after its header."""
    import numpy as np

    blocks, block = probe_blocks(pages), sum(pages)
    perm = np.random.default_rng(37).permutation(blocks).astype(np.int64)
    b = np.arange(blocks, dtype=np.int64)
    engine, host, size, offset = [], [], [], 0
    for page in pages:
        engine.append(engine_base + offset * blocks + b * page)
        host.append(host_base + perm * (block + SLOT_HEADER) + SLOT_HEADER + offset)
        size.append(np.full(blocks, page, dtype=np.int64))
        offset += page
    e, h, s = (np.concatenate(parts) for parts in (engine, host, size))
    return CopyPlan(e, h, s), CopyPlan(h, e.copy(), s.copy())


def time_mechanism(submitter: Any, pages: Sequence[int], engine_base: int, host_base: int, stream: int,
                   synchronize: Callable[[], None], repeats: int = 3) -> Timing:
    """Best wall seconds of each direction of the probe through `submitter` (one warm-up first)."""
    plans = probe_plans(pages, engine_base, host_base)
    best = []
    for plan in plans:
        submitter.submit(plan, stream)
        synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            submitter.submit(plan, stream)
            synchronize()
            times.append(time.perf_counter() - start)
        best.append(max(min(times), 1e-9))
    return Timing(plans[0].nbytes, best[0], best[1])


def pick(timings: Sequence[tuple[Any, Timing]]) -> Any:
    """The mechanism of the fastest timing (`timings` in order of preference): the first whose
    seconds are within `MARGIN` of the best. None for no timings."""
    if not timings:
        return None
    best = min(t.seconds for _, t in timings)
    return next(m for m, t in timings if t.seconds <= best * (1 + MARGIN))
