"""Prompt lookup's guesses (:func:`ensemble_core.decoding.lookup.propose`), on hand-made id lists."""

from __future__ import annotations

from ensemble_core.decoding.lookup import propose


def test_the_latest_match_of_the_longest_ngram_wins() -> None:
    history = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 1, 2, 3]
    assert propose(history, 3) == [9, 9, 7]  # [1, 2, 3] at the start beats the later bigram [2, 3]
    assert propose([5, 2, 3, 8, 1, 2, 3, 6, 0, 2, 3], 2) == [6, 0]  # the bigram [2, 3]: its latest match
    assert propose([7, 8, 4, 6, 0, 4], 5) == [6, 0, 4]  # only the last id matches: up to the end


def test_count_and_no_match() -> None:
    assert propose([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # as many as there are
    assert propose([1, 2, 3, 1, 2], 1) == [3]
    assert propose([1, 2, 3, 1, 2], 0) == [] and propose([1, 2, 3, 1, 2], -1) == []
    assert propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert propose([], 3) == [] and propose([5], 3) == []
    assert propose([5, 5], 3) == [5]  # a run of one id guesses more of it
    assert propose([1, 2, 3, 1, 2], 2, max_ngram=1) == [3, 1]  # only the last id matched
