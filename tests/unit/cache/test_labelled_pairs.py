"""The semantic tier's decision (similarity at the default threshold, then the trap check) on the
labelled pairs of `fow-cache` (paraphrases and traps written by a model; the figures in
docs/caching.md come from `python -m bench.cache_pairs`). The default threshold was picked on the
validation half; these floors hold on the test half and fail if a change to the check or the
threshold starts serving traps."""

from __future__ import annotations

import pytest

from bench.cache_pairs import SHOULD_HIT, TRAPS, load_pairs, score, served
from pipeline.cache.config import DEFAULT_THRESHOLD


@pytest.fixture(scope="module")
def test_half():  # type: ignore[no-untyped-def]
    return [row for row in score(load_pairs()) if row.split == "test"]


def test_at_most_two_percent_of_trap_pairs_are_served(test_half) -> None:  # type: ignore[no-untyped-def]
    traps = [r for r in test_half if r.pair.category in TRAPS]
    assert len(traps) > 100
    assert served(traps, DEFAULT_THRESHOLD, check=True) <= 2.0


def test_the_check_keeps_most_near_repeats_and_some_paraphrases(test_half) -> None:  # type: ignore[no-untyped-def]
    # Issue 10 asks for >= 50% of should-hit pairs; the check reaches 40.0% with spelling slips corrected
    # (36.7-37.3% before, depending on the host; docs/caching.md says why). These floors catch a regression,
    # they do not claim the target.
    near = [r for r in test_half if r.pair.category == "near_repeat"]
    should = [r for r in test_half if r.pair.category in SHOULD_HIT]
    assert served(near, DEFAULT_THRESHOLD, check=True) >= 80.0
    assert served(should, DEFAULT_THRESHOLD, check=True) >= 38.0
