"""Can a bundled member tell whether its question needs another tool call? (2026-12-07)

After each agent-suite task's first call and its result (the history a two-step task has when its
members repeat that call, docs/agents.md), one more user turn asks a yes/no question; the record is
each member's log P(yes) - log P(no) for the first token of its reply (the best of ``Yes``/``yes``/``
Yes`` against the same for ``No``), under its own chat format with the task's three tools offered.
A member that could judge would answer "yes" to ``more`` on the 4 two-step tasks and "no" on the 24
single-tool ones (``fully`` the other way round). One record per task and wording in
``next_step_probe.jsonl``.

    .venv/bin/python docs/results/agents/next_step_probe.py [--members qwen2.5-coder-0.5b-instruct ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from langchain_core.utils.function_calling import convert_to_openai_tool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import agent_suite as suite  # noqa: E402

from ensemble_core import Ensemble  # noqa: E402
from ensemble_core.constraints.structured import StructuredRequest, function_spec  # noqa: E402

WORDINGS = {
    "more": "Does answering my question need another tool call, using the result above? Answer yes or no.",
    "fully": "Does the tool result above already answer my whole question? Answer yes or no.",
}


def first_token_margin(member, text: str) -> float:
    """log P(yes) - log P(no) of the first token ``member`` writes after ``text`` (its rendered prompt)."""
    with torch.inference_mode():
        logits = member.model(torch.tensor([member.encode_prompt(text)])).logits[0, -1].float()
    logp = torch.log_softmax(logits, -1)

    def best(words: tuple[str, ...]) -> float:
        return max(logp[member.tokenizer.encode(w, add_special_tokens=False)[0]].item() for w in words)

    return best(("Yes", "yes", " Yes")) - best(("No", "no", " No"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", nargs="+", default=[suite.QWEN, suite.SMOL, suite.GEMMA])
    parser.add_argument("--out", type=Path, default=HERE / "next_step_probe.jsonl")
    args = parser.parse_args()
    ensemble = Ensemble(args.members, method="single" if len(args.members) == 1 else "safe")
    with args.out.open("w") as out:
        for task in suite.TASKS:
            tools = tuple(function_spec(convert_to_openai_tool(suite.TOOLS[n])) for n in task.toolbox())
            request = StructuredRequest(tools=tools, choice="auto")
            name, arguments = task.calls[0]
            call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for key, wording in WORDINGS.items():
                messages = [{"role": "user", "content": task.question},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "c1", "content": str(suite.TOOLS[name](**arguments))},
                            {"role": "user", "content": wording}]
                record = {"task": task.id, "two_step": task.two_step, "wording": key,
                          **{m.name: round(first_token_margin(m, m.render(messages, request)), 3)
                             for m in ensemble.members}}
                out.write(json.dumps(record) + "\n")
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
