"""Scoped logging for harnesses: a logger's level raised for one call, then put back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def logger_at(name: str, level: int) -> Iterator[None]:
    """Within the block (or the decorated call), logger `name` lets through `level` and above only;
    afterwards it has its previous level again, whatever happened inside. Harnesses that inject
    failures use it so their expected errors stay quiet without silencing the rest of the process."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
