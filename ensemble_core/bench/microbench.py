"""Verify-in-line vs separate scoring, timed on the members themselves."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ensemble_core.bench.datasets import cot_prompt
from ensemble_core.decoding.members import Member


def _synchronize(member: Member) -> None:
    """Wait for the member's accelerator (a no-op on the CPU)."""
    if member.device.type == "cuda":
        torch.cuda.synchronize(member.device)


def verify_microbench(members: list[Member], reps: int = 5, candidates: Sequence[int] = (2, 4)) -> dict[str, Any]:
    """Time SpecEM's verify-in-line pass against scoring each candidate separately.

    Calls :func:`ensemble_core.decoding.verify_inline.score_candidates_inline` and
    ``score_candidates_separately`` (the same scores, one pass per candidate) on every
    member, behind the same cached context (a GSM8K question), with candidate segments of
    about ten tokens; times are per call, summed over members. Reported as skipped when
    the module is missing.
    """
    try:
        from ensemble_core.decoding.verify_inline import score_candidates_inline, score_candidates_separately
    except ImportError as exc:
        return {"skipped": f"ensemble_core.decoding.verify_inline is not importable: {exc}"}
    prompt = cot_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                        "How many clips did Natalia sell altogether in April and May?")
    texts = [" First, she sold 48 clips in April and then", " In May she sold half as many, which is 24 clips",
             " Let's add the two months together to get", " The total number of clips is 48 + 24 = 72."]
    result: dict[str, Any] = {"reps": reps, "members": [m.name for m in members]}
    for k in candidates:
        chosen = (texts * ((k + len(texts) - 1) // len(texts)))[:k]
        times = {"inline": 0.0, "separate": 0.0}
        for member in members:
            state = member.start(prompt)
            state.score()  # prefill the context once; both scorers reuse its cache
            cands = [member.tokenizer(t, add_special_tokens=False)["input_ids"] for t in chosen]
            for name, fn in (("inline", score_candidates_inline), ("separate", score_candidates_separately)):
                fn(state, cands)  # warm-up
                _synchronize(member)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(state, cands)
                _synchronize(member)  # GPU kernels run asynchronously: wait before reading the clock
                times[name] += (time.perf_counter() - t0) / reps
        result[f"inline_s_{k}"] = times["inline"]
        result[f"separate_s_{k}"] = times["separate"]
        result[f"speedup_{k}"] = times["separate"] / times["inline"] if times["inline"] > 0 else None
    result["detail"] = ", ".join(f"{k} candidates: inline {result[f'inline_s_{k}'] * 1000:.0f} ms vs separate "
                                 f"{result[f'separate_s_{k}'] * 1000:.0f} ms ({result[f'speedup_{k}']:.2f}x)"
                                 for k in candidates)
    return result


