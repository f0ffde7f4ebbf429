"""Host reads per output token with tools (``tool_choice="auto"``, an agent's turn) on the bundled pair.

A call turn ("12 times 34", the call under its grammar: a read per token there) and a text turn with
the tools offered (free text: drafted unread, #38). One JSON line per method and question: reads per
token, the calls, an md5 of the text (the same text before and after a change makes counts comparable).
docs/gpu.md, "What the CPU already holds"; record: ``reads_with_tools.jsonl``.

    python docs/results/reads/reads_with_tools.py
"""

from __future__ import annotations

import hashlib
import json

from ensemble_core import Ensemble, Member
from ensemble_core.bench.host_reads import HostReads

MULTIPLY = {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
QUESTIONS = ["What is 12 times 34? Use the multiply tool.", "Explain in two sentences why the sky is blue."]
#: ``(method, options)``; SAFE drafts with Qwen (the first member) as published (a GPU's default drafting).
RUNS = [("safe", {"drafter": 0, "published": True}), ("every-token", {}), ("specem", {"parallel": False})]


def main() -> None:
    members = [Member.load("qwen2.5-coder-0.5b-instruct"), Member.load("smollm2-135m-instruct")]
    for method, options in RUNS:
        ensemble = Ensemble(members, method=method, max_new_tokens=64, batching=False, **options)
        ensemble.generate("Hello there", max_new_tokens=4, tools=[MULTIPLY])  # first-use work is not per token
        for question in QUESTIONS:
            with HostReads() as reads:
                result = ensemble.generate(question, tools=[MULTIPLY])
            tokens = result.stats.get("tokens", result.completion_tokens)
            print(json.dumps({"method": method, "q": question[:20], "tokens": tokens,
                              "reads_per_token": round(reads.per_token(tokens), 2),
                              "calls": [(c.name, c.arguments) for c in result.tool_calls],
                              "md5": hashlib.md5(result.text.encode()).hexdigest()[:10]}), flush=True)


if __name__ == "__main__":
    main()
