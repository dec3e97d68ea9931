"""`--capacities` quotes a bad item as it was given: 'junk' was reported as 'jun' (a trailing k or m
was stripped before quoting), 'mk' as 'm'."""

from __future__ import annotations

import pytest

from kvtier.bench.replay import parse_counts
from kvtier.cli.main import main


@pytest.mark.parametrize("text, quoted", [
    ("10k,junk", "'junk'"), ("10k,mk", "'mk'"), ("10k, Junk ", "'Junk'"), ("5m5", "'5m5'"), ("k", "'k'"),
])
def test_a_bad_count_is_quoted_as_given(text, quoted):
    with pytest.raises(ValueError) as info:
        parse_counts(text)
    assert str(info.value) == f"{quoted} is not a block count (write e.g. 2k,10k,40000)"


@pytest.mark.parametrize("text, shown", [("2000000m", "2000000m"), ("2000000M", "2000000M"), ("0k", "0k")])
def test_an_out_of_range_count_is_shown_as_given(text, shown):
    with pytest.raises(ValueError, match=f"^{shown} is out of range: a block count is from 1 to "):
        parse_counts(text)


def test_the_command_quotes_it_too(capsys, monkeypatch):
    monkeypatch.setattr("kvtier.cli.bench.load_config", lambda path: pytest.fail("the config was read first"))
    assert main(["bench", "trace", "--capacities", "10k,junk", "--no-progress"]) == 2
    assert "kvtier: error: --capacities: 'junk' is not a block count" in capsys.readouterr().err


def test_good_counts_still_parse():
    assert parse_counts("2k, 10K ,1m,40000") == [2000, 10_000, 1_000_000, 40_000]
