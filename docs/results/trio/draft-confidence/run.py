"""SAFE with early-ending drafts (``draft_confidence``) vs fixed drafts, SmolLM2 drafting for Qwen, vs Qwen alone.

Run on a quiet machine: ``python docs/results/trio/draft-confidence/run.py [threads] [questions] [tokens] [thresholds]
[verifier]`` (thresholds comma-separated, e.g. ``0,0.3,0.5``; the verifier an alias, default Qwen2.5-Coder; results
go to ``results-<verifier>.json``). One process, members loaded once; on every
GSM8K question (zero-shot CoT, greedy) Qwen alone through Hugging Face ``generate`` (the
benchmark's ``single`` row) and SAFE at every threshold, the order reversed on every other
question. Prints a markdown table and writes the results next to this script.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ensemble_core import Ensemble, Member
from ensemble_core.bench.datasets import cot_prompt, load_dataset, score
from ensemble_core.bench.runner import HFSingleRunner
from ensemble_core.models.loading import cpu_model

STOP = ("\nQuestion:",)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    questions = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    thresholds = [float(t) for t in (sys.argv[4] if len(sys.argv) > 4 else "0,0.3,0.5").split(",")]
    verifier = sys.argv[5] if len(sys.argv) > 5 else "qwen2.5-coder-0.5b-instruct"
    torch.set_num_threads(threads)
    drafter, qwen = Member.load("smollm2-135m-instruct"), Member.load(verifier)
    safe = Ensemble([drafter, qwen], method="safe", max_new_tokens=tokens, stop=STOP)
    alone = HFSingleRunner(qwen, stop=STOP)
    safe.generate("Warm up.", max_new_tokens=4)
    alone.run([{"role": "user", "content": "Warm up."}], 4)
    runs: list[dict] = []
    for q, problem in enumerate(load_dataset("gsm8k", questions)):
        prompt = cot_prompt(problem.question)
        order: list[float | None] = [None, *thresholds]
        for t in order if q % 2 == 0 else order[::-1]:
            if t is None:
                out = alone.run(prompt, tokens)
                text, seconds, n, stats = out.text, out.seconds, out.tokens, {}
            else:
                t0 = time.perf_counter()
                r = safe.generate(prompt, draft_confidence=t)
                text, seconds, n, stats = r.text, time.perf_counter() - t0, r.completion_tokens, r.stats
            runs.append({"question": problem.id, "threshold": t, "seconds": seconds, "tokens": n, "chars": len(text),
                         "correct": score(text, problem.answer)[1], "text": text,
                         "rounds": stats.get("rounds"), "drafted": stats.get("drafted"), "e_t": stats.get("e_t"),
                         "members": stats.get("members")})
            print(q, "qwen" if t is None else f"safe@{t}", f"{seconds:.1f}s {n}t", flush=True)
    lines = ["| row | ms/token | x verifier alone per token | s/100 chars | x verifier alone per char "
             "| drafted per committed token "
             "| rounds | E/T | correct |", "|---|" + "---:|" * 8]
    summary = {}
    base = [r for r in runs if r["threshold"] is None]
    q_tok = sum(r["seconds"] for r in base) / sum(r["tokens"] for r in base)
    q_chr = sum(r["seconds"] for r in base) / sum(r["chars"] for r in base)
    for t in [None, *thresholds]:
        rs = [r for r in runs if r["threshold"] == t]
        per_tok = sum(r["seconds"] for r in rs) / sum(r["tokens"] for r in rs)
        per_chr = sum(r["seconds"] for r in rs) / sum(r["chars"] for r in rs)
        drafted = sum(r["drafted"] or 0 for r in rs) / sum(r["tokens"] for r in rs)
        rounds = sum(r["rounds"] or 0 for r in rs)
        et = (sum((r["e_t"] or 0) * r["tokens"] for r in rs) / sum(r["tokens"] for r in rs)) if t is not None else None
        correct = sum(r["correct"] for r in rs)
        summary[str(t)] = {"ms_per_token": per_tok * 1e3, "s_per_100_chars": per_chr * 100, "drafted_per_token": drafted,
                           "rounds": rounds, "e_t": et, "correct": correct}
        label = f"{verifier} alone" if t is None else f"SAFE, draft_confidence {t}"
        lines.append(f"| {label} | {per_tok * 1e3:.0f} | {per_tok / q_tok:.2f}x | {per_chr * 100:.2f} | "
                     f"{per_chr / q_chr:.2f}x | {drafted:.2f} | {rounds} | "
                     f"{'' if et is None else f'{et:.1%}'} | {correct}/{len(rs)} |")
    print("\n".join(lines))
    Path(__file__).with_name(f"results-{verifier}.json").write_text(json.dumps(
        {"verifier": verifier, "threads": threads, "questions": questions, "max_new_tokens": tokens, "thresholds": thresholds,
         "cpu": cpu_model(), "torch": torch.__version__, "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
