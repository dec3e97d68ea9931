"""Byte-size units: their table and `format_size`, the way every message writes a size."""

from __future__ import annotations

SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def format_size(n: int) -> str:
    """`n` bytes in the largest unit it reaches: a whole number of it as a config would write it
    (`4GiB`, `512B`), else to 3 significant digits (`1.50GiB`, `76.0GiB`, `388KiB`)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = SIZE_UNITS[unit]
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
        value = n / size
        if value >= 0.9995:  # (what rounds to 1.00 of this unit is shown in it, never as 1024 of the next)
            decimals = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{decimals}f}{unit}"
    return f"{n}B"
