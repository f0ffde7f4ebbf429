"""SAFE (SmolLM2 drafting, Qwen verifying) vs Qwen alone, before and after fused projections + prepacked weights.

Run on a quiet machine: ``python docs/results/trio/cpu-kernels/safe_ab.py [threads] [questions] [tokens]``.
One process, the models loaded once; the layout of both members' weights is switched in
place (``fused_prepacked.Layouts``: ``plain`` = every linear layer its own dense oneDNN
product, the layout before; ``fused+prepacked`` = the default now). On every GSM8K
question, zero-shot CoT, greedy: Qwen alone through Hugging Face ``generate`` (the
benchmark's ``single`` row) and the SAFE pair, in both layouts, the order of layouts
alternating by question so that drift hits both. Outputs must be identical across layouts
(the layouts change no value). Prints a markdown table and writes ``safe_ab.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fused_prepacked import Layouts  # noqa: E402

from ensemble_core import Ensemble, Member  # noqa: E402
from ensemble_core.bench.datasets import cot_prompt, load_dataset  # noqa: E402
from ensemble_core.bench.runner import HFSingleRunner  # noqa: E402
from ensemble_core.models.loading import cpu_model  # noqa: E402

LAYOUTS = ("plain", "fused+prepacked")


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    questions = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    torch.set_num_threads(threads)
    drafter, qwen = Member.load("smollm2-135m-instruct"), Member.load("qwen2.5-coder-0.5b-instruct")
    layouts = [Layouts(drafter.model), Layouts(qwen.model)]
    safe = Ensemble([drafter, qwen], method="safe", max_new_tokens=tokens)
    alone = HFSingleRunner(qwen, stop=("\nQuestion:",))
    safe.generate("Warm up.", max_new_tokens=4)
    alone.run([{"role": "user", "content": "Warm up."}], 4)
    rows: list[dict] = []
    for q, problem in enumerate(load_dataset("gsm8k", questions)):
        prompt = cot_prompt(problem.question)
        for layout in LAYOUTS if q % 2 == 0 else LAYOUTS[::-1]:
            for lay in layouts:
                lay.use(layout)
            single = alone.run(prompt, tokens)
            t0 = time.perf_counter()
            r = safe.generate(prompt, stop=("\nQuestion:",))
            seconds = time.perf_counter() - t0
            rows.append({"question": problem.id, "layout": layout,
                         "qwen": {"seconds": single.seconds, "tokens": single.tokens, "chars": len(single.text),
                                  "text": single.text},
                         "safe": {"seconds": seconds, "tokens": r.completion_tokens, "chars": len(r.text), "text": r.text,
                                  "members": [m for m in r.stats["members"]]}})
            print(q, layout, f"qwen {single.seconds:.1f}s/{single.tokens}t  safe {seconds:.1f}s/{r.completion_tokens}t",
                  flush=True)
    for lay in layouts:
        lay.use("fused+prepacked")

    def total(layout: str, who: str, key: str) -> float:
        return sum(r[who][key] for r in rows if r["layout"] == layout)

    identical = all(a[w]["text"] == b[w]["text"] for a, b in zip(rows[::2], rows[1::2]) for w in ("qwen", "safe"))
    lines = ["| layout | Qwen ms/token | SAFE ms/token | SAFE / Qwen per token | Qwen s/100 chars | SAFE s/100 chars "
             "| SAFE / Qwen per char | SmolLM2 pass ms | Qwen verify pass ms |", "|---|" + "---:|" * 8]
    summary = {}
    for layout in LAYOUTS:
        qt = total(layout, "qwen", "seconds") / total(layout, "qwen", "tokens") * 1e3
        st = total(layout, "safe", "seconds") / total(layout, "safe", "tokens") * 1e3
        qc = total(layout, "qwen", "seconds") / total(layout, "qwen", "chars") * 100
        sc = total(layout, "safe", "seconds") / total(layout, "safe", "chars") * 100
        passes = {role: [m for r in rows if r["layout"] == layout for m in r["safe"]["members"] if m["role"] == role]
                  for role in ("drafter", "verifier")}
        per = {role: sum(m["seconds"] for m in ms) / sum(m["forward_passes"] for m in ms) * 1e3
               for role, ms in passes.items()}
        summary[layout] = {"qwen_ms_per_token": qt, "safe_ms_per_token": st, "qwen_s_per_100_chars": qc,
                           "safe_s_per_100_chars": sc, "ms_per_pass": per}
        lines.append(f"| {layout} | {qt:.0f} | {st:.0f} | {st / qt:.2f}x | {qc:.2f} | {sc:.2f} | {sc / qc:.2f}x "
                     f"| {per['drafter']:.0f} | {per['verifier']:.0f} |")
    lines.append(f"\nidentical outputs across layouts: {identical}")
    print("\n".join(lines))
    Path(__file__).with_name("safe_ab.json").write_text(json.dumps(
        {"threads": threads, "questions": questions, "max_new_tokens": tokens, "cpu": cpu_model(),
         "torch": torch.__version__, "summary": summary, "identical_outputs": identical, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
