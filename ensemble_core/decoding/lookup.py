"""Prompt lookup: tokens a drafter guesses from n-gram matches in its own context.

Prompt lookup decoding (Saxena, 2023; transformers' ``prompt_lookup_num_tokens``):
chain-of-thought answers copy names, numbers and phrases from the question and from
themselves, so the tokens that followed the latest earlier occurrence of the last few
tokens are a free guess of what comes next. SAFE's drafter feeds such a guess together
with its next token in ONE forward pass and keeps the guessed tokens it chooses anyway
(:func:`ensemble_core.decoding.drafting.draft_tokens`): every token is still chosen by the same
``choose_token`` from the drafter's own row, in the same order, so the draft is the one
token-by-token drafting makes (greedy and seeded sampling alike), up to the rounding of a
pass over several tokens, in fewer passes. Why it pays on a CPU: a decoding step there is
bound by reading the weights, so a pass over a few more tokens costs about one pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from ensemble_core.decoding.scheduler import concurrent_requests

#: Longest n-gram matched (then shorter ones): 3 tokens pin a phrase, 1 still finds a number.
MAX_NGRAM = 3


def propose(history: Sequence[int], count: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``count`` ids that followed the latest earlier occurrence of ``history``'s last n ids.

    n runs from ``max_ngram`` down to 1; the first n with a match wins, and of its matches
    the latest (the most recent context is the best guess for a reply that repeats
    itself). Empty when nothing matches or ``count`` < 1.
    """
    if count < 1:
        return []
    ids = list(history)
    size = len(ids)
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = ids[size - n:]
        for start in range(size - n - 1, -1, -1):  # a match must leave at least one id after it
            if ids[start:start + n] == tail:
                return ids[start + n:start + n + count]
    return []


def guesses_now(prompt_lookup: int, max_requests: int | None) -> int:
    """How many guesses a drafter feeds per pass now: ``prompt_lookup`` while at most
    ``max_requests`` requests decode together (this one included), else 0.

    Why: guesses are free only while a pass is bound by reading the weights. Batched with
    other requests a pass is bound by compute, and every guess is a token computed for each
    row; with 8 concurrent SAFE requests on a 2-core CPU, 4 guesses per pass cut the batched
    throughput (docs/benchmarks.md, "Prompt lookup under batching"). vLLM turns speculative
    decoding off above a batch size for the same reason. Switching does not change the draft
    (each token is chosen from the drafter's own row either way).
    """
    if prompt_lookup == 0 or max_requests is None:
        return prompt_lookup
    return prompt_lookup if concurrent_requests() <= max_requests else 0
