"""Tiny random-weight members with real tokenizers, for fast tests and GPU shape checks.

Building a model from a transformers config costs milliseconds and needs no weights, but
keeping the bundled models' *real* tokenizers keeps every cross-tokenizer code path real.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.verify_inline import score_candidates_inline
from ensemble_core.models.bundled import BUNDLED, convert_gguf
from ensemble_core.models.products import use_cpu_products


@functools.cache
def bundled_tokenizer(alias: str) -> Any:
    """The real tokenizer of a bundled model (converted once, then read from the cache; one per process)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(convert_gguf(BUNDLED[alias].locate()), local_files_only=True)


def tiny_config(alias: str, tokenizer: Any, hidden: int = 64, layers: int = 2, **overrides: Any) -> Any:
    """A config of the bundled model's architecture with the tokenizer's vocabulary.

    Small by default; ``overrides`` replace any field (heads, intermediate size, ...), so
    the same function also builds full-size shapes (``tests/gpu_check.py``).
    """
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if alias.startswith("gemma"):
        fields.update(head_dim=hidden // 4, sliding_window=512,
                      layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)])
        return Gemma3TextConfig(**{**fields, **overrides})
    if alias.startswith("qwen"):  # Qwen2: q/k/v biases; the bundled GGUF has its own (untied) lm_head
        return Qwen2Config(**{**fields, "tie_word_embeddings": False, **overrides})
    return LlamaConfig(**{**fields, "tie_word_embeddings": True, **overrides})


def tiny_member(alias: str, seed: int = 0, name: str | None = None, **overrides: Any) -> Member:
    """A random-weight member shaped like ``alias`` with its real tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = bundled_tokenizer(alias)
    config = tiny_config(alias, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    use_cpu_products(model)  # as loaded members do
    return Member(model, tokenizer, name=name or f"tiny-{alias}-{seed}")


def feed_jobs(states: list[Any], feeds: list[list[int]]) -> list[Any]:
    """Each state's feed as the :class:`~ensemble_core.decoding.forward.Job` ``DecodeState.score`` would submit.

    The ids count as cached afterwards: the caller runs the jobs in one batched pass (tests
    of :func:`~ensemble_core.decoding.forward.batched_forward` without a batcher).
    """
    jobs = []
    for state, feed in zip(states, feeds):
        state.ids.extend(feed)
        jobs.append(state._job(state.ids[state.cached:], len(feed)))
        state.cached = len(state.ids)
    return jobs


def random_ids(n: int, seed: int, lo: int = 200, hi: int = 5000) -> list[int]:
    """``n`` reproducible random token ids in ``[lo, hi)`` (ordinary tokens of every bundled vocabulary)."""
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_last_row(member: Member, ids: list[int]) -> torch.Tensor:
    """Next-token logits after ``ids`` from one plain, cache-free forward pass (the reference)."""
    with torch.inference_mode():
        return member.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def reference_greedy(member: Member, prompt_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from Hugging Face ``model.generate`` (the reference for incremental decoding)."""
    ids = torch.tensor([prompt_ids])
    out = member.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                pad_token_id=member.tokenizer.pad_token_id or 0)
    return out[0, ids.shape[1]:].tolist()


def greedy_decode(state: Any, n: int) -> list[int]:
    """Up to ``n`` greedy tokens through a ``DecodeState`` (stops after the member's EOS)."""
    row, out = state.score()[-1], []
    for _ in range(n):
        tok = int(row.argmax())
        out.append(tok)
        if tok in state.member.eos_token_ids:
            break
        row = state.score([tok])[-1]
    return out


@dataclass(frozen=True)
class Agreement:
    """How two states of one model agreed under :func:`lockstep`: the largest logit difference, greedy steps alike."""

    max_diff: float
    same_tokens: int
    steps: int


def lockstep(a: DecodeState, b: DecodeState, steps: int) -> Agreement:
    """Drive two states of the same weights through every kind of pass a method makes, and compare.

    Per step: a greedy decode step, a feed of 1-5 tokens (draft / verify windows), every third
    step a crop of three tokens (a rejected draft), and three packed candidates scored in line
    (SpecEM, generate-then-select), one of them empty and two scored as finished. Both states
    are fed ``a``'s greedy token, so they stay in step when a near-tie flips. Used to hold
    static passes to eager ones (tests/test_static_passes.py, and on a GPU tests/gpu_papers.py).
    """
    worst, same_tokens = 0.0, 0

    def compare(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal worst
        worst = max(worst, float((x.float() - y.float().to(x.device)).abs().max()))

    for step in range(steps):
        ra, rb = a.score(), b.score()
        compare(ra, rb)
        token = int(ra[-1].argmax())
        same_tokens += token == int(rb[-1].argmax())
        feed = [token, *random_ids(step % 5, step)]
        compare(a.score(feed), b.score(feed))
        if step % 3 == 2:
            a.crop(len(a.ids) - 3)
            b.crop(len(b.ids) - 3)
        candidates = [random_ids(3, step + 100), random_ids(5, step + 200), []]
        ends = [False, True, True]
        for x, y in zip(score_candidates_inline(a, candidates, terminal=ends),
                        score_candidates_inline(b, candidates, terminal=ends)):
            compare(x, y)
    return Agreement(worst, same_tokens, steps)
