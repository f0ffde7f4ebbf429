"""Prompt-lookup drafting (``prompt_lookup``) vs token-by-token drafting, SmolLM2 and Qwen2.5-Coder, on GSM8K.

Run on a quiet machine: ``python docs/results/trio/prompt-lookup/run.py [threads] [questions] [tokens] [rows] [name]``
(rows comma-separated keys of ``ROWS``; default: the first study's). One process, members
loaded once; on every GSM8K question (zero-shot CoT, greedy, the first ``questions`` of
the test set) every row runs, the order reversed on every other question:

* ``qwen``: Qwen alone through Hugging Face ``generate`` (the benchmark's ``single`` row);
  ``qwen-hf-lookup``: with transformers' own prompt lookup (``prompt_lookup_num_tokens=10``,
  its defaults), the fair baseline for a lever the biggest member could use alone too;
* ``safe*``: SAFE, SmolLM2 drafting, Qwen verifying, at several ``prompt_lookup`` /
  ``lookahead`` / ``draft_confidence`` settings; ``specem*``: SpecEM on the same pair.

Prints a markdown table and writes ``results-<name>.json`` (every run, with its text) next to this script.
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

#: key: (label, method, options); method None is Qwen alone ("hf-lookup": with transformers' prompt lookup).
ROWS: dict[str, tuple[str, str | None, dict]] = {
    "qwen": ("Qwen alone", None, {}),
    "qwen-hf-lookup": ("Qwen alone, HF prompt lookup", "hf-lookup", {}),
    "safe": ("SAFE, lookup 0", "safe", {"prompt_lookup": 0}),
    "safe-l4": ("SAFE, lookup 4", "safe", {"prompt_lookup": 4}),
    "safe-n8-l7": ("SAFE, lookahead 8, lookup 7", "safe", {"prompt_lookup": 7, "lookahead": 8}),
    "safe-l4-c05": ("SAFE, lookup 4, draft_confidence 0.5", "safe", {"prompt_lookup": 4, "draft_confidence": 0.5}),
    "specem": ("SpecEM, lookup 0", "specem", {"prompt_lookup": 0}),
    "specem-l4": ("SpecEM, lookup 4", "specem", {"prompt_lookup": 4}),
    "specem-l9": ("SpecEM, lookup 9", "specem", {"prompt_lookup": 9}),
}
FIRST_STUDY = "qwen,qwen-hf-lookup,safe,safe-l4,safe-n8-l7"


@torch.inference_mode()
def qwen_lookup(member: Member, prompt: list[dict[str, str]], tokens: int) -> tuple[str, float, int]:
    """Qwen greedy with transformers' prompt lookup decoding: text, seconds, new tokens."""
    ids = member.encode_prompt(member.render(prompt))
    input_ids = torch.tensor([ids])
    eos = sorted(member.eos_token_ids)
    t0 = time.perf_counter()
    out = member.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=eos[0], prompt_lookup_num_tokens=10)
    seconds = time.perf_counter() - t0
    new = [t for t in out[0, len(ids):].tolist() if t not in member.eos_token_ids]
    return member.decode(new).lstrip(), seconds, len(new)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    questions = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    keys = (sys.argv[4] if len(sys.argv) > 4 else FIRST_STUDY).split(",")
    name = sys.argv[5] if len(sys.argv) > 5 else "safe"
    torch.set_num_threads(threads)
    drafter, qwen = Member.load("smollm2-135m-instruct"), Member.load("qwen2.5-coder-0.5b-instruct")
    methods = {m: Ensemble([drafter, qwen], method=m, max_new_tokens=tokens)
               for m in {ROWS[k][1] for k in keys} - {None, "hf-lookup"}}
    alone = HFSingleRunner(qwen)
    for method in methods.values():
        method.generate("Warm up.", max_new_tokens=4)
    alone.run([{"role": "user", "content": "Warm up."}], 4)
    qwen_lookup(qwen, [{"role": "user", "content": "Warm up."}], 4)
    runs: list[dict] = []
    for q, problem in enumerate(load_dataset("gsm8k", questions)):
        prompt = cot_prompt(problem.question)
        for key in keys if q % 2 == 0 else keys[::-1]:
            label, method, options = ROWS[key]
            stats: dict = {}
            if method is None:
                out = alone.run(prompt, tokens)
                text, seconds, n = out.text, out.seconds, out.tokens
            elif method == "hf-lookup":
                text, seconds, n = qwen_lookup(qwen, prompt, tokens)
            else:
                t0 = time.perf_counter()
                r = methods[method].generate(prompt, **options)
                text, seconds, n, stats = r.text, time.perf_counter() - t0, r.completion_tokens, r.stats
            members = stats.get("members", [])
            drafting = [m for m in members if m["role"] in ("drafter", "drafter+verifier")]
            runs.append({"question": problem.id, "row": label, "key": key, "method": method, "seconds": seconds,
                         "tokens": n, "chars": len(text), "correct": score(text, problem.answer)[1], "text": text,
                         "rounds": stats.get("rounds"), "e_t": stats.get("e_t"),
                         "drafter_passes": sum(m["forward_passes"] for m in drafting) if drafting else None,
                         "members": members})
            print(q, label, f"{seconds:.1f}s {n}t", flush=True)
    base = [r for r in runs if r["key"] == "qwen"]
    q_tok = sum(r["seconds"] for r in base) / sum(r["tokens"] for r in base)
    q_chr = sum(r["seconds"] for r in base) / sum(r["chars"] for r in base)
    plain = {(r["method"], r["question"]): r["text"] for r in runs if r["key"] in ("safe", "specem")}
    lines = ["| row | ms/token | x Qwen alone per token | s/100 chars | x Qwen alone per char | drafting passes per "
             "token | same text as lookup 0 | correct |", "|---|" + "---:|" * 7]
    summary = {}
    for key in keys:
        label, method = ROWS[key][:2]
        rs = [r for r in runs if r["key"] == key]
        per_tok = sum(r["seconds"] for r in rs) / sum(r["tokens"] for r in rs)
        per_chr = sum(r["seconds"] for r in rs) / sum(r["chars"] for r in rs)
        drafts = [r["drafter_passes"] for r in rs if r["drafter_passes"] is not None]
        passes = sum(drafts) / sum(r["tokens"] for r in rs) if drafts else None
        same = sum(r["text"] == plain.get((method, r["question"])) for r in rs)
        correct = sum(r["correct"] for r in rs)
        summary[label] = {"ms_per_token": per_tok * 1e3, "x_qwen_per_token": per_tok / q_tok,
                          "s_per_100_chars": per_chr * 100, "x_qwen_per_char": per_chr / q_chr,
                          "drafting_passes_per_token": passes, "same_text_as_lookup_0": same, "correct": correct,
                          "questions": len(rs)}
        compared = f"{same}/{len(rs)}" if (method, rs[0]["question"]) in plain else "–"
        lines.append(f"| {label} | {per_tok * 1e3:.0f} | {per_tok / q_tok:.2f}x | {per_chr * 100:.2f} | "
                     f"{per_chr / q_chr:.2f}x | {'–' if passes is None else f'{passes:.2f}'} | {compared} | "
                     f"{correct}/{len(rs)} |")
    print("\n".join(lines))
    Path(__file__).with_name(f"results-{name}.json").write_text(json.dumps(
        {"threads": threads, "questions": questions, "max_new_tokens": tokens, "rows": keys, "cpu": cpu_model(),
         "torch": torch.__version__, "summary": summary, "runs": runs}, indent=1, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
