"""Selection pieces shared by SpecEM and generate-then-select: segment clean-up, score
normalisation, the weighted vote and when members run in threads."""

from __future__ import annotations

import math

import pytest

from ensemble_core import Member
from ensemble_core.methods.selection import normalize_scores, postprocess_segment, select_candidate, use_threads
from ensemble_core.methods.specem import SpecEMConfig


@pytest.mark.parametrize("text,finished,expected", [
    (" The answer is forty", False, " The answer is"),      # mid-word: back to the last space
    (" The answer is 4.", False, " The answer is 4."),       # ends at punctuation: kept
    (" so 48 / 2 = 24 \n", False, " so 48 / 2 = 24"),        # trailing whitespace left to the next round
    (" Supercalifragilistic", False, " Supercalifragilistic"),  # nothing to cut at: kept whole
    ("\n\n", False, "\n\n"),                                  # whitespace only: kept (progress)
    (" The answer is forty", True, " The answer is forty"),  # finished (EOS / stop): kept whole
    (" caf\ufffd", False, " caf"),                            # lone U+FFFD dropped (then: word kept whole)
    ("", False, ""),
])
def test_postprocess_segment(text: str, finished: bool, expected: str) -> None:
    assert postprocess_segment(text, finished) == expected


def test_normalisation_keeps_rankings_even_with_negative_logits() -> None:
    raw = [-2.0, -1.0, -4.0]  # mean raw logits can be negative: candidate 1 is best
    published = [s / sum(raw) for s in raw]  # the published divide-by-sum flips the order
    assert max(range(3), key=lambda i: published[i]) != 1
    for how in ("softmax", "minmax", "none"):
        norm = normalize_scores(raw, how)
        assert max(range(3), key=lambda i: norm[i]) == 1
    soft = normalize_scores(raw, "softmax")
    assert math.isclose(sum(soft), 1.0) and all(s > 0 for s in soft)
    assert normalize_scores([-1.0, -math.inf], "softmax") == [1.0, 0.0]  # an abstention gets nothing
    assert normalize_scores([3.0, 3.0], "minmax") == [1.0, 1.0]


def test_selection_is_weighted_vote() -> None:
    s = [[0.9, 0.1], [0.2, 0.8]]
    assert select_candidate([0.5, 0.5], s)[0] == 0  # 0.55 vs 0.45
    assert select_candidate([0.3, 0.7], s)[0] == 1  # weights decide
    assert select_candidate([0.5, 0.5], [[0.5, 0.5], [0.5, 0.5]])[0] == 0  # ties: first candidate
    assert select_candidate([0.5, 0.5], [[1.0, -math.inf], [1.0, 0.0]])[0] == 0


def test_automatic_threads(tiny_llama: Member, tiny_gemma: Member, monkeypatch: pytest.MonkeyPatch) -> None:
    """None: threads for distinct CPU members on a multi-core machine, never for shared objects."""
    auto, on, off = SpecEMConfig(), SpecEMConfig(parallel=True), SpecEMConfig(parallel=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert use_threads([tiny_llama, tiny_gemma], auto) and not use_threads([tiny_llama, tiny_gemma], off)
    same_tokenizer = Member(tiny_llama.model, tiny_llama.tokenizer, name="again")  # one fast tokenizer, two threads
    assert not use_threads([tiny_llama, same_tokenizer], auto) and use_threads([tiny_llama, same_tokenizer], on)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert not use_threads([tiny_llama, tiny_gemma], auto)


@pytest.mark.real
def test_own_draft_scores_equal_the_packed_pass_and_are_not_fed_again(real_pair: list[Member]) -> None:
    """A verifier scores its own candidate from the rows it drafted from: the same values as
    the packed verify pass (up to summation order), with fewer tokens fed to that pass, for
    both scoring kinds, on both real members, and for a finished candidate (stopped one token
    early: its end score is the next draft row's)."""
    import torch

    from ensemble_core.decoding.drafting import DraftScores
    from ensemble_core.decoding.generation import GenerationConfig
    from ensemble_core.decoding.view import start_views
    from ensemble_core.methods.selection import Candidate, draft, verify
    from ensemble_core.text.alignment import decode_suffix

    config = GenerationConfig(max_new_tokens=40)
    views = start_views(real_pair, [{"role": "user", "content": "Name three colours and say why."}], config)
    shared = "Red, green"
    for view in views:
        view.commit(*view.appended("", shared))
    cands = [draft(views[i], i, 10, (), shared) for i in range(2)]
    assert all(isinstance(c.scores, DraftScores) and c.text for c in cands)
    for i, view in enumerate(views):
        ids = cands[i].scores.ids
        ended = Candidate(i, decode_suffix(real_pair[i].tokenizer, view.state.ids, list(ids[:-1])), "stop",
                          len(ids) - 1, cands[i].scores)
        for kind in ("logprob", "logit"):
            for batch in (cands, [ended, cands[1 - i]] if i == 0 else [cands[0], ended]):
                fed = view.state.stats.tokens_fed
                own, _ = verify(view, shared, batch, kind, i)
                fed_own = view.state.stats.tokens_fed - fed
                fed = view.state.stats.tokens_fed
                plain, _ = verify(view, shared, batch, kind, None)
                fed_plain = view.state.stats.tokens_fed - fed
                assert torch.allclose(torch.tensor(own), torch.tensor(plain), atol=1e-4), (i, kind, own, plain)
                assert fed_own < fed_plain, (i, kind, fed_own, fed_plain)  # its own candidate left out of the pass
