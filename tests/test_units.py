"""`format_size`, the way every message writes a size (issue 36.12: `config check --env` printed
"77860.85MiB" free; a size that is no whole number of its largest unit now has 3 significant
digits in that unit)."""

from __future__ import annotations

from kvtier.config import parse_size
from kvtier.core.units import format_size


def test_whole_sizes_are_written_as_a_config_would_write_them_and_read_back():
    for text in ("512B", "1KiB", "64GiB", "3TiB", "1500TiB"):
        assert format_size(parse_size(text)) == text


def test_other_sizes_take_the_largest_unit_with_three_significant_digits():
    assert format_size(81_642_553_344) == "76.0GiB"  # 7e6c7c1: 77860.85MiB
    assert format_size(3 << 29) == "1.50GiB"
    assert format_size(397_312) == "388KiB"
    assert format_size(1_395_864_371) == "1.30GiB"  # 7e6c7c1: 1363148.80KiB
    assert format_size((1 << 20) - 1) == "1.00MiB"  # never "1024KiB"
    assert format_size(1023) == "1023B"
