"""Type stub of the compiled `cudaMemcpyAsync` loop (kvtier/transfer/handlers/_memcpy_loop.pyx)."""

from typing import Any

def submit_copies(function: int, dst: Any, src: Any, size: Any, kind: int, stream: int) -> tuple[int, int]: ...
