"""Parse rates of forced tool calls and pydantic outputs on the bundled REAL pair, per method.

The suite checks the 20 + 20 prompts of ``tests/test_agents.py`` on tiny random-weight
members (fast); this script runs the same prompts on SmolLM2-135M + Gemma-3-270m through
``ChatEnsemble`` for SAFE, SpecEM and every-token and records, per method: calls that parse
and validate against the tool's schema, pydantic outputs that validate, replies cut by the
token budget (the grammar's only way to fail), and seconds. Values are not judged here.

    .venv/bin/python docs/results/agents/parse_rates.py [--max-tokens 160] [--out parse_rates.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from langchain_ensemble import ChatEnsemble  # noqa: E402
from test_agents import METHODS, PAIR, STRUCTURED_PROMPTS, TOOL_PROMPTS, TOOLS, _valid_call  # noqa: E402


def run(method: str, max_tokens: int) -> dict:
    chat = ChatEnsemble(members=PAIR, method=method, max_tokens=max_tokens)
    calls, call_cut, t0 = 0, 0, time.perf_counter()
    for prompt, choice in TOOL_PROMPTS:
        message = chat.bind_tools(TOOLS, tool_choice=choice).invoke(prompt)
        try:
            calls += _valid_call(message, choice)
        except Exception:  # noqa: BLE001 - arguments that do not validate count as a failure
            pass
        call_cut += message.response_metadata["finish_reason"] == "length"
    t1 = time.perf_counter()
    parsed, cut, tokens = 0, 0, 0
    for prompt, schema in STRUCTURED_PROMPTS:
        out = chat.with_structured_output(schema, include_raw=True).invoke(prompt)
        parsed += isinstance(out["parsed"], schema) and out["parsing_error"] is None
        cut += out["raw"].response_metadata["finish_reason"] == "length"
        tokens += out["raw"].usage_metadata["output_tokens"]
    t2 = time.perf_counter()
    row = {"method": method, "tool_calls": f"{calls}/{len(TOOL_PROMPTS)}", "tool_calls_cut": call_cut,
           "tool_seconds": round(t1 - t0, 1), "pydantic": f"{parsed}/{len(STRUCTURED_PROMPTS)}",
           "pydantic_cut": cut, "pydantic_tokens": tokens, "pydantic_seconds": round(t2 - t1, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("parse_rates.json"))
    args = parser.parse_args()
    rows = [run(m, args.max_tokens) for m in args.methods]
    args.out.write_text(json.dumps({"members": PAIR, "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
