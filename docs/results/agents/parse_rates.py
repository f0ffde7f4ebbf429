"""Parse rates of forced tool calls and pydantic outputs on the bundled REAL pair, per method.

The suite checks the 20 + 20 prompts of ``tests/test_agents.py`` on tiny random-weight
members (fast); this script runs the same prompts on SmolLM2-135M + Gemma-3-270m through
``ChatEnsemble`` for SAFE, SpecEM and every-token and records, per prompt: the call or the
parsed object, whether it validates against the tool's / model's schema, whether the token
budget cut it (the grammar's only way to fail), output tokens and seconds. Values are
recorded for reading, not judged. Records go to ``parse_rates.jsonl`` (one line per prompt,
a run resumes where it stopped); the per-method summary to ``parse_rates.json``.

    .venv/bin/python docs/results/agents/parse_rates.py [--max-tokens 160] [--threads 1] [--methods safe specem every-token]
        [--loop-penalty X] [--close-margin N] [--only PROMPT_PART ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from langchain_ensemble import ChatEnsemble  # noqa: E402
from test_agents import METHODS, PAIR, STRUCTURED_PROMPTS, TOOL_PROMPTS, TOOLS, _valid_call  # noqa: E402

from ensemble_core.decoding.generation import GenerationConfig  # noqa: E402


def tool_record(chat: ChatEnsemble, prompt: str, choice: str) -> dict:
    t0 = time.perf_counter()
    message = chat.bind_tools(TOOLS, tool_choice=choice).invoke(prompt)
    try:
        ok = _valid_call(message, choice)
    except Exception:  # noqa: BLE001 - arguments that do not validate count as a failure
        ok = False
    return {"kind": "tool", "prompt": prompt, "choice": choice, "ok": bool(ok),
            "calls": [{"name": c["name"], "args": c["args"]} for c in message.tool_calls],
            "invalid": [c.get("args") for c in message.invalid_tool_calls],
            "cut": message.response_metadata["finish_reason"] == "length",
            "tokens": message.usage_metadata["output_tokens"], "seconds": round(time.perf_counter() - t0, 2)}


def structured_record(chat: ChatEnsemble, prompt: str, schema: type) -> dict:
    t0 = time.perf_counter()
    out = chat.with_structured_output(schema, include_raw=True).invoke(prompt)
    ok = isinstance(out["parsed"], schema) and out["parsing_error"] is None
    return {"kind": "pydantic", "prompt": prompt, "schema": schema.__name__, "ok": bool(ok),
            "parsed": out["parsed"].model_dump(mode="json") if ok else None,
            "raw": out["raw"].content if not ok else None,
            "cut": out["raw"].response_metadata["finish_reason"] == "length",
            "tokens": out["raw"].usage_metadata["output_tokens"], "seconds": round(time.perf_counter() - t0, 2)}


def summarize(method: str, records: list[dict]) -> dict:
    row: dict = {"method": method}
    for kind in ("tool", "pydantic"):
        rs = [r for r in records if r["kind"] == kind]
        row[kind] = {"parsed": f"{sum(r['ok'] for r in rs)}/{len(rs)}", "cut": sum(r["cut"] for r in rs),
                     "tokens": sum(r["tokens"] for r in rs), "seconds": round(sum(r["seconds"] for r in rs), 1)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--loop-penalty", type=float, default=None,
                        help="GenerationConfig.loop_penalty (default: the library's; 0 = the rates before it existed)")
    parser.add_argument("--close-margin", type=int, default=None,
                        help="GenerationConfig.close_margin (default: the library's; 0 = the rates before it existed)")
    parser.add_argument("--only", nargs="+", default=None, help="run only prompts containing one of these strings")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("parse_rates.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    log = args.out.with_suffix(".jsonl")
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    seen = {(r["method"], r["kind"], r["prompt"]) for r in done}
    with log.open("a") as sink:
        for method in args.methods:
            options = {} if args.loop_penalty is None else {"loop_penalty": args.loop_penalty}
            if args.close_margin is not None:
                options["close_margin"] = args.close_margin
            chat = ChatEnsemble(members=PAIR, method=method, max_tokens=args.max_tokens, **options)
            jobs = [("tool", p, c) for p, c in TOOL_PROMPTS] + [("pydantic", p, s) for p, s in STRUCTURED_PROMPTS]
            for kind, prompt, extra in jobs:
                if (method, kind, prompt) in seen or (args.only and not any(o in prompt for o in args.only)):
                    continue
                make = tool_record if kind == "tool" else structured_record
                record = {"method": method, **make(chat, prompt, extra)}
                sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                sink.flush()
                done.append(record)
                print(json.dumps(record, ensure_ascii=False), flush=True)
    rows = [summarize(m, [r for r in done if r["method"] == m]) for m in args.methods]
    for row in rows:
        print(json.dumps(row), flush=True)
    loop_penalty = GenerationConfig().loop_penalty if args.loop_penalty is None else args.loop_penalty
    close_margin = GenerationConfig().close_margin if args.close_margin is None else args.close_margin
    args.out.write_text(json.dumps({"members": PAIR, "max_tokens": args.max_tokens, "loop_penalty": loop_penalty,
                                    "close_margin": close_margin, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
