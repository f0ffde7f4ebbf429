"""Interleaved lookahead sweep: SAFE (SmolLM2 drafting) on the Qwen pair, ms per output token."""
import json, sys, time, torch, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[1]))
from ensemble_core import Ensemble
from ensemble_core.ensemble import resolve_members
from ensemble_core.datasets import cot_prompt, load_dataset
pair = resolve_members(["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
values = [int(v) for v in sys.argv[2].split(",")]
n, tokens = int(sys.argv[3]), int(sys.argv[4])
problems = load_dataset("gsm8k", n, 0, None)
ens = {k: Ensemble(pair, method="safe", lookahead=k, max_new_tokens=tokens) for k in values}
single = Ensemble([pair[1]], method="single", max_new_tokens=tokens)
single.generate("Warm up.", max_new_tokens=4); ens[values[0]].generate("Warm up.", max_new_tokens=4)
rows = []
for p in problems:
    prompt = cot_prompt(p.question)
    order = values + ["qwen"] if len(rows) % 2 == 0 else ["qwen"] + values[::-1]
    for k in order:
        e = single if k == "qwen" else ens[k]
        t = time.perf_counter(); r = e.generate(prompt); dt = time.perf_counter() - t
        st = r.stats
        rows.append({"q": p.id, "lookahead": k, "seconds": dt, "chars": len(r.text), "tokens": r.completion_tokens,
                     "e_t": st.get("e_t"), "drafted": st.get("drafted"), "accepted": st.get("accepted"),
                     "rounds": st.get("rounds")})
        print(json.dumps(rows[-1]), flush=True)
