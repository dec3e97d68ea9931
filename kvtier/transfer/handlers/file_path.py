"""Which path moves a file tier's blocks to and from the engine's KV cache: direct or staged.

- *direct* (`gpu_file_direct.DirectGPUFileHandler`): kvikio between device memory and the slab.
  Fast only with GPUDirect Storage, that is with the `nvidia-fs` driver loaded. Without it kvikio
  runs in compatibility mode and bounces through its own buffers, slower than the staged path
  (measured figures: docs/gds.md).
- *staged* (`gpu_file.GPUFileHandler`): the tier's own I/O (O_DIRECT where the filesystem takes
  it) into pinned host memory, and one DMA per job between it and the device.

`choose_file_path` decides from the tier's `io` option and the platform's facts: `auto` takes
the direct path only where GPUDirect Storage is real; `io: kvikio` is the user's explicit
choice and always gets the direct path where it can run at all (CUDA and kvikio); `io: posix`
always the staged one. `file_path(io)` answers for this machine (for `kvtier config check --env`
and the start-up log), without importing torch.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

COMPAT_COST = "0.4-0.8x of staged on an H100 (docs/benchmarks.md)"


@dataclass(frozen=True)
class PlatformFacts:
    """What the choice depends on: the KV cache is on CUDA, kvikio imports, and the GPUDirect
    Storage driver is loaded (`/proc/driver/nvidia-fs` present and `/proc/modules` readable:
    `kvtier.tiers.file.fileio.gds_platform`)."""

    cuda: bool
    kvikio: bool
    nvidia_fs: bool


def platform_facts(cuda: bool | None = None) -> PlatformFacts:
    """This machine's facts; `cuda` None means "an NVIDIA GPU is visible" (device nodes). Without
    CUDA nothing else matters and nothing else is probed (kvikio is not imported): all False."""
    from kvtier.tiers.file import fileio

    if not (fileio.gpu_present() if cuda is None else cuda):
        return PlatformFacts(False, False, False)
    return PlatformFacts(True, fileio.kvikio_importable(), fileio.gds_platform())


def choose_file_path(io: str, facts: PlatformFacts) -> tuple[str, str]:
    """`("direct" | "staged", why)` for a file tier with `io` (auto | posix | kvikio)."""
    if io not in ("auto", "posix", "kvikio"):
        raise ValueError(f"io {io!r} is not an I/O kind; use auto, posix or kvikio")
    if not facts.cuda:
        return "staged", "the KV cache is not on a CUDA device"
    if io == "posix":
        return "staged", "io: posix"
    if not facts.kvikio:
        return "staged", "kvikio does not import"
    if io == "kvikio":
        if facts.nvidia_fs:
            return "direct", "io: kvikio, GPUDirect Storage (nvidia-fs driver loaded)"
        return "direct", f"io: kvikio chosen explicitly; no nvidia-fs driver, so kvikio runs in compatibility mode, " \
                         f"{COMPAT_COST}"
    if facts.nvidia_fs:
        return "direct", "GPUDirect Storage: the nvidia-fs driver is loaded"
    return "staged", f"no nvidia-fs driver: kvikio would run in compatibility mode, {COMPAT_COST}"


def file_path(io: str = "auto", cuda: bool | None = None) -> tuple[str, str]:
    """The choice for a file tier with `io` on this machine (`cuda` None: a GPU is visible)."""
    return choose_file_path(io, platform_facts(cuda))


_logged: set[tuple[str, str, str]] = set()
_logged_lock = threading.Lock()


def log_choice(tier: str, choice: str, why: str) -> None:
    """Log a tier's engine <-> file path at INFO, once per process for each (tier, choice, why)."""
    with _logged_lock:
        if (tier, choice, why) in _logged:
            return
        _logged.add((tier, choice, why))
    log.info("file tier %s: engine<->file path %s (%s)", tier, choice, why)
