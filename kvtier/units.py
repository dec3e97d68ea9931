"""Byte-size units: their table and `format_size`, the way every message writes a size."""

from __future__ import annotations

SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def format_size(n: int) -> str:
    """`n` bytes as a config would write them: `4GiB`, `1.50GiB`, `512B`."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= SIZE_UNITS[unit] and n % (SIZE_UNITS[unit] // 1024 or 1) == 0:
            value = n / SIZE_UNITS[unit]
            return f"{value:g}{unit}" if value == int(value) else f"{value:.2f}{unit}"
    return f"{n}B"
