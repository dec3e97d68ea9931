"""Harnesses quiet the router's expected failure logs for their own run only."""

from __future__ import annotations

import logging

import pytest

from benchmarks import soak
from kvtier.bench.quiet import logger_at


def test_soak_leaves_the_router_logger_as_it_found_it():
    router_log = logging.getLogger("kvtier.transfer.router")
    router_log.setLevel(logging.INFO)
    try:
        soak.run(300, seed=1)
        assert router_log.level == logging.INFO
    finally:
        router_log.setLevel(logging.NOTSET)


def test_the_level_comes_back_after_an_error():
    log = logging.getLogger("kvtier.test-quiet")
    with pytest.raises(RuntimeError):
        with logger_at(log.name, logging.ERROR):
            assert log.level == logging.ERROR
            raise RuntimeError("inside")
    assert log.level == logging.NOTSET
