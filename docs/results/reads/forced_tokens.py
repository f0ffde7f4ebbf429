"""Forward passes per output token where a grammar forces tokens, with the forced tokens fed as guesses and without.

A call turn (``tool_choice="auto"``: the call under its lazy grammar), a forced call (``"required"``) and a
``response_format`` value on the bundled pair (Qwen2.5-Coder-0.5B first, SmolLM2-135M), greedy. "off" is
the same code with :meth:`TokenPipeline.forced` returning nothing (one token per pass where the grammar
forces bytes, as before #38's forced guesses); the two alternate within each repetition, so the time ratio
is taken on the same machine state. One JSON line per method, request and mode: passes per output token
(every member's passes, summed), median ms per token, an md5 of the text (the same text on and off).
docs/gpu.md, "Tokens a grammar forces"; record: ``forced_tokens.jsonl``.

    python docs/results/reads/forced_tokens.py
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time

from ensemble_core import Ensemble, Member
from ensemble_core.decoding.pipeline import TokenPipeline

MULTIPLY = {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
REQUESTS = {
    "call (auto)": ("What is 12 times 34? Use the multiply tool.", {"tools": [MULTIPLY]}),
    "call (required)": ("What is 12 times 34? Use the multiply tool.", {"tools": [MULTIPLY], "tool_choice": "required"}),
    "value (schema)": ("Ada Lovelace, 36, lives in London. Give her as JSON.",
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}),
}
#: ``(method, options, members)``: SAFE drafts with Qwen as published (a GPU's default drafting).
RUNS = [("single", {}, 1), ("safe", {"drafter": 0, "published": True}, 2), ("every-token", {}, 2),
        ("specem", {"parallel": False}, 2), ("generate-then-select", {"parallel": False}, 2)]
REPS = 3
_FORCED = TokenPipeline.forced


def _mode(on: bool) -> None:
    TokenPipeline.forced = _FORCED if on else (lambda self, limit: [])  # type: ignore[method-assign]


def main() -> None:
    members = [Member.load("qwen2.5-coder-0.5b-instruct"), Member.load("smollm2-135m-instruct")]
    for method, options, count in RUNS:
        ensemble = Ensemble(members[:count], method=method, max_new_tokens=64, batching=False, **options)
        ensemble.generate("Hello there", max_new_tokens=4, tools=[MULTIPLY])  # first-use work is not per token
        for name, (question, request) in REQUESTS.items():
            seen: dict[str, dict] = {}
            times: dict[str, list[float]] = {"on": [], "off": []}
            for _ in range(REPS):
                for mode in ("on", "off"):
                    _mode(mode == "on")
                    t0 = time.perf_counter()
                    result = ensemble.generate(question, **request)
                    seconds = time.perf_counter() - t0
                    tokens = result.stats.get("tokens", result.completion_tokens)
                    times[mode].append(1000 * seconds / tokens)
                    seen[mode] = {"tokens": tokens, "passes": sum(m.forward_passes for m in result.stats.members),
                                  "md5": hashlib.md5(result.text.encode()).hexdigest()[:10],
                                  "calls": [(c.name, c.arguments) for c in result.tool_calls]}
            _mode(True)
            for mode in ("on", "off"):
                row = seen[mode]
                print(json.dumps({"method": method, "request": name, "forced_guesses": mode, "tokens": row["tokens"],
                                  "passes_per_token": round(row["passes"] / row["tokens"], 2),
                                  "ms_per_token": round(statistics.median(times[mode]), 1),
                                  "calls": row["calls"], "md5": row["md5"]}), flush=True)


if __name__ == "__main__":
    main()
