"""Pinning a CPU tier's region for CUDA: `cudaHostRegister` in chunks that end on slot boundaries,
undone by `unregister` (`kvtier.tiers.cpu.backend.CPUBackend`'s `pin` option)."""

from __future__ import annotations

import logging

log = logging.getLogger("kvtier.tiers.cpu.backend")  # (the backend's messages)

MAX_REGISTER_BYTES = 16 << 30  # bytes registered by one call at most
CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def register(name: str, base: int, size: int, stride: int, required: bool) -> list[int]:
    """Pin `size` bytes from address `base` (slots of `stride` bytes); the addresses registered
    (pass them to `unregister`). Without CUDA, or when a registration fails (what was registered
    is undone), RuntimeError when `required`, else [] (logged: the region stays pageable)."""
    import torch

    if not torch.cuda.is_available():
        if required:
            raise RuntimeError(f"CPUBackend {name!r}: pin=true but CUDA is not available")
        return []
    cudart = torch.cuda.cudart()
    pinned: list[int] = []
    chunk = max(MAX_REGISTER_BYTES // stride, 1) * stride  # chunks end on slot boundaries: no block straddles two
    for offset in range(0, size, chunk):
        addr, length = base + offset, min(chunk, size - offset)
        err = cudart.cudaHostRegister(addr, length, CUDA_HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            _clear_cuda_error()
            unregister(pinned)
            message = f"CPUBackend {name!r}: cudaHostRegister failed ({err}) at offset {offset}"
            if required:
                raise RuntimeError(message)
            log.warning("%s; the region stays pageable", message)
            return []
        pinned.append(addr)
    return pinned


def unregister(pinned: list[int]) -> None:
    """Undo `register`'s registrations (the list is emptied)."""
    if not pinned:
        return
    import torch

    cudart = torch.cuda.cudart()
    for addr in reversed(pinned):
        cudart.cudaHostUnregister(addr)
    pinned.clear()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration, so that a later, unrelated
    launch check does not report it. Best effort: torch does not bind cudaGetLastError."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass
