"""Agents with DEFAULT settings on the bundled models: 24 single-tool tasks and 4 two-step tasks (#39).

Every task runs through LangGraph's ``create_react_agent(chat, tools)``, LlamaIndex's
``FunctionAgent(tools=..., llm=llm)`` and LangChain 1.x's ``create_agent(chat, tools)``
(``--frameworks``; all three by default), each with its defaults (``tool_choice="auto"``, no
forced call, no per-step policy), on two configurations in one interleaved run (task by
task, so that the machine's load hits both alike):

* ``safe``: SAFE, Qwen2.5-Coder-0.5B-Instruct drafting for SmolLM2-135M-Instruct;
* ``single``: Qwen2.5-Coder-0.5B-Instruct alone (``method="single"``);

and on request (``--configs``) the other methods on the same pair: ``specem``, ``every-token``,
``generate-then-select``.

The tools are real Python functions (arithmetic, lookups in dicts, string tools, unit
conversions); each task offers three of them (the right one and two from other
categories). A run **finishes** when the right tool was called with the right arguments
(numbers by value, strings case-insensitively), the final answer contains the tool's result,
and the agent stopped by itself (no recursion-limit / max-iterations stop). Two-step tasks
need both calls, in order, and the second result in the answer. Recorded besides: every
call the agent saw (valid, invalid, repeated), whether each valid call matches its tool's
JSON Schema, the final answer, model calls and seconds.

Bounds (2 shared CPU cores): ``max_tokens`` 80 per model call; LangGraph
and LangChain ``recursion_limit`` 8 (single-tool: 4 model calls) and 10 (two-step); FunctionAgent
``max_iterations`` 4 and 6. Records go to ``agent_suite.jsonl`` (one line per run; a run
resumes where it stopped), the summary to ``agent_suite.json`` and ``agent_suite.md``.

    .venv/bin/python docs/results/agents/agent_suite.py [--configs safe single] [--frameworks langgraph llamaindex langchain]
        [--tasks 1 2 ...] [--max-tokens 80] [--out docs/results/agents/agent_suite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QWEN, SMOL, GEMMA = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma3-270m"
CONFIGS: dict[str, dict[str, Any]] = {
    "safe": {"members": [QWEN, SMOL], "method": "safe"},
    "single": {"members": [QWEN], "method": "single"},
    # the other methods on the same pair, with their defaults (``--configs specem every-token ... single``)
    "specem": {"members": [QWEN, SMOL], "method": "specem"},
    "every-token": {"members": [QWEN, SMOL], "method": "every-token"},
    "generate-then-select": {"members": [QWEN, SMOL], "method": "generate-then-select"},
    # SAFE on the SmolLM2 + Gemma-3 pair (``--configs safe-smol-gemma``)
    "safe-smol-gemma": {"members": [SMOL, GEMMA], "method": "safe"},
    # without the members' prefix caches (``--configs safe safe-no-prefix-cache``: what the cache saves, in one
    # interleaved run; the members load their weights once, each configuration keeps its own caches)
    "safe-no-prefix-cache": {"members": [QWEN, SMOL], "method": "safe", "member_options": {"prefix_cache": 0}},
    "single-no-prefix-cache": {"members": [QWEN], "method": "single", "member_options": {"prefix_cache": 0}},
}
#: What a plain run compares (docs/agents.md's main table).
DEFAULT_CONFIGS = ("safe", "single")
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- tools
def _num(x: float) -> float:
    """A result as a reader expects it: 408 rather than 408.0, at most 4 decimals."""
    x = round(float(x), 4)
    return int(x) if x == int(x) else x


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return _num(a * b)


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return _num(a + b)


def subtract(a: float, b: float) -> float:
    """Subtract b from a."""
    return _num(a - b)


def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return _num(a / b)


def power(base: float, exponent: float) -> float:
    """Raise base to the power exponent."""
    return _num(base ** exponent)


def square_root(x: float) -> float:
    """The square root of a number."""
    return _num(math.sqrt(x))


CAPITALS = {"peru": "Lima", "kenya": "Nairobi", "france": "Paris", "japan": "Tokyo", "canada": "Ottawa"}
CURRENCIES = {"japan": "Yen", "brazil": "Real", "india": "Rupee", "mexico": "Peso"}
SYMBOLS = {"gold": "Au", "sodium": "Na", "iron": "Fe", "silver": "Ag"}
AUTHORS = {"dune": "Frank Herbert", "moby dick": "Herman Melville", "emma": "Jane Austen"}


def _lookup(table: dict[str, str], key: str) -> str:
    return table.get(key.strip().lower(), f"unknown: {key}")


def capital_of(country: str) -> str:
    """Look up the capital city of a country."""
    return _lookup(CAPITALS, country)


def currency_of(country: str) -> str:
    """Look up the currency used in a country."""
    return _lookup(CURRENCIES, country)


def element_symbol(element: str) -> str:
    """Look up the chemical symbol of an element."""
    return _lookup(SYMBOLS, element)


def author_of(book: str) -> str:
    """Look up the author of a book."""
    return _lookup(AUTHORS, book)


def reverse_text(text: str) -> str:
    """Reverse a text, character by character."""
    return text[::-1]


def count_letters(text: str) -> int:
    """Count the letters in a text."""
    return sum(c.isalpha() for c in text)


def to_uppercase(text: str) -> str:
    """Convert a text to upper case."""
    return text.upper()


def count_words(text: str) -> int:
    """Count the words in a text."""
    return len(text.split())


def celsius_to_fahrenheit(celsius: float) -> float:
    """Convert a temperature from degrees Celsius to degrees Fahrenheit."""
    return _num(celsius * 9 / 5 + 32)


def km_to_miles(km: float) -> float:
    """Convert a distance from kilometers to miles."""
    return _num(round(km * 0.621371, 2))


TOOLS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    multiply, add, subtract, divide, power, square_root, capital_of, currency_of, element_symbol, author_of,
    reverse_text, count_letters, to_uppercase, count_words, celsius_to_fahrenheit, km_to_miles)}
CATEGORY = {**dict.fromkeys(["multiply", "add", "subtract", "divide", "power", "square_root"], "math"),
            **dict.fromkeys(["capital_of", "currency_of", "element_symbol", "author_of"], "lookup"),
            **dict.fromkeys(["reverse_text", "count_letters", "to_uppercase", "count_words"], "text"),
            **dict.fromkeys(["celsius_to_fahrenheit", "km_to_miles"], "units")}
DISTRACTORS = {"math": ["capital_of", "reverse_text"], "lookup": ["multiply", "count_words"],
               "text": ["add", "currency_of"], "units": ["author_of", "to_uppercase"]}


# ----------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class Task:
    id: int
    question: str
    calls: tuple[tuple[str, dict[str, Any]], ...]  # the expected calls, in order
    tools: tuple[str, ...] = ()

    @property
    def two_step(self) -> bool:
        return len(self.calls) > 1

    def toolbox(self) -> list[str]:
        if self.tools:
            return list(self.tools)
        name = self.calls[0][0]
        box = list(DISTRACTORS[CATEGORY[name]])
        box.insert(self.id % 3, name)  # the right tool at varying positions
        return box

    @property
    def result(self) -> Any:
        name, args = self.calls[-1]
        return TOOLS[name](**args)


SINGLE = [
    ("What is 12 times 34?", "multiply", {"a": 12, "b": 34}),
    ("What is 1234 plus 5678?", "add", {"a": 1234, "b": 5678}),
    ("What is 900 minus 357?", "subtract", {"a": 900, "b": 357}),
    ("What is 144 divided by 16?", "divide", {"a": 144, "b": 16}),
    ("What is 2 to the power of 10?", "power", {"base": 2, "exponent": 10}),
    ("What is the square root of 729?", "square_root", {"x": 729}),
    ("What is 25 times 25?", "multiply", {"a": 25, "b": 25}),
    ("What is the capital of Peru?", "capital_of", {"country": "Peru"}),
    ("What is the capital of Kenya?", "capital_of", {"country": "Kenya"}),
    ("Which currency is used in Japan?", "currency_of", {"country": "Japan"}),
    ("What currency does Brazil use?", "currency_of", {"country": "Brazil"}),
    ("What is the chemical symbol of gold?", "element_symbol", {"element": "gold"}),
    ("What is the chemical symbol of sodium?", "element_symbol", {"element": "sodium"}),
    ("Who wrote the book Dune?", "author_of", {"book": "Dune"}),
    ("Who is the author of Moby Dick?", "author_of", {"book": "Moby Dick"}),
    ("Reverse the text 'stressed'.", "reverse_text", {"text": "stressed"}),
    ("Reverse the word 'drawer'.", "reverse_text", {"text": "drawer"}),
    ("How many letters are in the word 'encyclopedia'?", "count_letters", {"text": "encyclopedia"}),
    ("Convert 'hello world' to uppercase.", "to_uppercase", {"text": "hello world"}),
    ("How many words are in the sentence 'the quick brown fox jumps'?", "count_words", {"text": "the quick brown fox jumps"}),
    ("Convert 100 degrees Celsius to Fahrenheit.", "celsius_to_fahrenheit", {"celsius": 100}),
    ("Convert 37 degrees Celsius to Fahrenheit.", "celsius_to_fahrenheit", {"celsius": 37}),
    ("How many miles is 42 km?", "km_to_miles", {"km": 42}),
    ("How many miles are 10 kilometers?", "km_to_miles", {"km": 10}),
]
TWO_STEP = [
    ("What is (6 times 7) plus 5? Use the tools: first multiply, then add.",
     (("multiply", {"a": 6, "b": 7}), ("add", {"a": 42, "b": 5})), ("multiply", "add", "capital_of")),
    ("What is the capital of France, written backwards?",
     (("capital_of", {"country": "France"}), ("reverse_text", {"text": "Paris"})), ("capital_of", "reverse_text", "add")),
    ("How many letters does the capital of Kenya have?",
     (("capital_of", {"country": "Kenya"}), ("count_letters", {"text": "Nairobi"})), ("capital_of", "count_letters", "multiply")),
    ("Convert 20 degrees Celsius to Fahrenheit, then multiply the result by 2.",
     (("celsius_to_fahrenheit", {"celsius": 20}), ("multiply", {"a": 68, "b": 2})),
     ("celsius_to_fahrenheit", "multiply", "reverse_text")),
]
TASKS = [Task(i + 1, q, ((name, args),)) for i, (q, name, args) in enumerate(SINGLE)] + \
        [Task(len(SINGLE) + i + 1, q, calls, tools) for i, (q, calls, tools) in enumerate(TWO_STEP)]


# ----------------------------------------------------------------------------- judging
def same_args(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Numbers by value, strings case- and space-insensitively; no missing or extra argument."""
    if set(got) != set(want):
        return False
    for key, value in want.items():
        other = got[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                if not math.isclose(float(other), float(value), rel_tol=1e-6):
                    return False
            except (TypeError, ValueError):
                return False
        elif str(other).strip().lower() != str(value).strip().lower():
            return False
    return True


def result_strings(result: Any) -> list[str]:
    """Ways an answer may write a tool result: 408, 408.0, 6,912, 26.1; a string case-insensitively."""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        out = {str(result), f"{result:g}", f"{float(result):.1f}", f"{result:,}"}
        if float(result) == int(result):
            out |= {str(int(result)), f"{int(result):,}"}
        return sorted(out)
    return [str(result).lower()]


def has_result(answer: str, result: Any) -> bool:
    """The result in the answer: a number as a whole number (``12`` is not in ``124`` nor in ``1.12``), a string
    case-insensitively."""
    text = answer.lower()
    if isinstance(result, str):
        return result.lower() in text
    return any(re.search(r"(?<![\w.,])" + re.escape(s) + r"(?![\w]|[.,]\d)", text) for s in result_strings(result))


def schema_ok(name: str, args: dict[str, Any]) -> bool:
    """Whether a call's arguments match its tool's JSON Schema (as LangChain derives it)."""
    import jsonschema
    from langchain_core.utils.function_calling import convert_to_openai_tool

    params = convert_to_openai_tool(TOOLS[name])["function"]["parameters"]
    params = {**params, "additionalProperties": False}
    return not list(jsonschema.Draft202012Validator(params).iter_errors(args))


@dataclass
class Run:
    """One task on one configuration in one framework."""

    framework: str
    config: str
    task: int
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "args", "valid", "schema_ok"}
    answer: str = ""
    stop: str = "answer"  # answer | limit | error
    error: str | None = None
    model_calls: int = 0
    repeated: int = 0
    seconds: float = 0.0

    def judge(self, task: Task) -> dict[str, Any]:
        valid = [(c["name"], c["args"]) for c in self.calls if c["valid"]]
        expected = list(task.calls)
        right_tool = all(any(n == name for n, _ in valid) for name, _ in expected)
        right_args = all(any(n == name and same_args(a, args) for n, a in valid) for name, args in expected)
        in_order = right_args and _in_order(valid, expected)
        answer_ok = has_result(self.answer, task.result)
        return {"right_tool": right_tool, "right_args": right_args and in_order, "answer_has_result": answer_ok,
                "finished": right_args and in_order and answer_ok and self.stop == "answer"}


def _in_order(valid: list[tuple[str, dict[str, Any]]], expected: list[tuple[str, dict[str, Any]]]) -> bool:
    at = 0
    for name, args in valid:
        if at < len(expected) and name == expected[at][0] and same_args(args, expected[at][1]):
            at += 1
    return at == len(expected)


# ----------------------------------------------------------------------------- frameworks
def run_langgraph(task: Task, config: dict[str, Any], max_tokens: int) -> Run:
    """LangGraph's prebuilt ``create_react_agent(chat, tools)``."""
    import warnings

    with warnings.catch_warnings():  # LangGraph 1.x: "moved to langchain.agents" (it still works)
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent
    return _run_graph("langgraph", create_react_agent, task, config, max_tokens)


def run_langchain(task: Task, config: dict[str, Any], max_tokens: int) -> Run:
    """LangChain 1.x's ``create_agent(chat, tools)`` (the successor of ``create_react_agent``)."""
    from langchain.agents import create_agent

    return _run_graph("langchain", create_agent, task, config, max_tokens)


def _run_graph(framework: str, build: Callable[..., Any], task: Task, config: dict[str, Any], max_tokens: int) -> Run:
    """One task through an agent graph ``build(chat, tools)`` whose state holds the messages."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import StructuredTool
    from langchain_ensemble import ChatEnsemble
    from langgraph.errors import GraphRecursionError

    run = Run(framework, "", task.id)
    chat = ChatEnsemble(members=config["members"], method=config["method"], max_tokens=max_tokens,
                        member_options=config.get("member_options", {}))
    tools = [StructuredTool.from_function(TOOLS[n]) for n in task.toolbox()]
    agent = build(chat, tools)
    limit = 10 if task.two_step else 8
    messages: list[Any] = []
    try:
        for state in agent.stream({"messages": [HumanMessage(task.question)]}, {"recursion_limit": limit},
                                  stream_mode="values"):
            messages = state["messages"]
    except GraphRecursionError as e:
        run.stop, run.error = "limit", str(e)[:200]
    except Exception as e:  # noqa: BLE001 - recorded, counted as not finished
        run.stop, run.error = "error", f"{type(e).__name__}: {str(e)[:200]}"
    for m in messages:
        if isinstance(m, AIMessage):
            run.model_calls += 1
            run.calls += [{"name": c["name"], "args": c["args"], "valid": True, "schema_ok": schema_ok(c["name"], c["args"])}
                          for c in m.tool_calls if c["name"] in TOOLS]
            run.calls += [{"name": c["name"], "args": c["args"], "valid": True, "schema_ok": False}
                          for c in m.tool_calls if c["name"] not in TOOLS]
            run.calls += [{"name": c.get("name"), "args": c.get("args"), "valid": False, "schema_ok": False,
                           "error": c.get("error")} for c in m.invalid_tool_calls]
            run.repeated += len(m.response_metadata.get("repeated_tool_calls", []))
    if run.stop == "answer" and messages and isinstance(messages[-1], AIMessage):
        run.answer = str(messages[-1].content)
    elif messages:
        last = [m for m in messages if isinstance(m, AIMessage)]
        run.answer = str(last[-1].content) if last else ""
    return run


async def _llamaindex(task: Task, config: dict[str, Any], max_tokens: int) -> Run:
    from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.ensemble import EnsembleLLM
    from llama_index.llms.ensemble.messages import INVALID_CALL

    run = Run("llamaindex", "", task.id)
    llm = EnsembleLLM(members=config["members"], method=config["method"], max_new_tokens=max_tokens,
                      member_options=config.get("member_options", {}))
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(TOOLS[n]) for n in task.toolbox()], llm=llm)
    try:
        handler = agent.run(task.question, max_iterations=6 if task.two_step else 4)
        async for ev in handler.stream_events():
            if isinstance(ev, AgentOutput):
                run.model_calls += 1
                raw = ev.raw if isinstance(ev.raw, dict) else {}
                run.repeated += len(raw.get("repeated_tool_calls", []))
            elif isinstance(ev, ToolCallResult):
                valid = ev.tool_name != INVALID_CALL
                args = ev.tool_kwargs if valid else (ev.tool_kwargs or {}).get("arguments")
                name = ev.tool_name if valid else (ev.tool_kwargs or {}).get("name")
                run.calls.append({"name": name, "args": args, "valid": valid,
                                  "schema_ok": valid and name in TOOLS and schema_ok(name, args)})
        run.answer = str(await handler)
    except Exception as e:  # noqa: BLE001 - max iterations, or anything else: not finished
        text = f"{type(e).__name__}: {str(e)[:200]}"
        run.stop, run.error = ("limit" if "Max iterations" in text else "error"), text
    return run


def run_llamaindex(task: Task, config: dict[str, Any], max_tokens: int) -> Run:
    return asyncio.run(_llamaindex(task, config, max_tokens))


FRAMEWORKS = {"langgraph": run_langgraph, "llamaindex": run_llamaindex, "langchain": run_langchain}


# ----------------------------------------------------------------------------- summary
def rejudged(record: dict[str, Any]) -> dict[str, Any]:
    """A record with its verdict computed again from what it holds (the judge may have been fixed since)."""
    task = next(t for t in TASKS if t.id == record["task"])
    run = Run(record["framework"], record["config"], record["task"], record["calls"], record["answer"], record["stop"])
    return {**record, **run.judge(task)}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    records = [rejudged(r) for r in records]
    rows: dict[str, Any] = {}
    for key in sorted({(r["framework"], r["config"], r["two_step"]) for r in records}):
        group = [r for r in records if (r["framework"], r["config"], r["two_step"]) == key]
        calls = [c for r in group for c in r["calls"]]
        rows["/".join([key[0], key[1], "two-step" if key[2] else "single-tool"])] = {
            "runs": len(group),
            "finished": sum(r["finished"] for r in group),
            "right_tool": sum(r["right_tool"] for r in group),
            "right_args": sum(r["right_args"] for r in group),
            "answer_has_result": sum(r["answer_has_result"] for r in group),
            "limit_stops": sum(r["stop"] == "limit" for r in group),
            "errors": sum(r["stop"] == "error" for r in group),
            "calls": len(calls),
            "calls_parsed": sum(c["valid"] for c in calls),
            "schema_breaking_calls": sum(c["valid"] and not c["schema_ok"] for c in calls),
            "repeated_calls_dropped": sum(r["repeated"] for r in group),
            "model_calls": sum(r["model_calls"] for r in group),
            "seconds": round(sum(r["seconds"] for r in group), 1),
        }
    return rows


def markdown(summary: dict[str, Any]) -> str:
    lines = ["| framework / config / tasks | finished | right tool | right args | result in answer | limit stops | "
             "errors | calls parsed | schema-breaking calls | repeats dropped | model calls | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in summary.items():
        n = row["runs"]
        lines.append(f"| {key} | {row['finished']}/{n} | {row['right_tool']}/{n} | {row['right_args']}/{n} | "
                     f"{row['answer_has_result']}/{n} | {row['limit_stops']} | {row['errors']} | "
                     f"{row['calls_parsed']}/{row['calls']} | {row['schema_breaking_calls']} | "
                     f"{row['repeated_calls_dropped']} | {row['model_calls']} | {row['seconds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    parser.add_argument("--tasks", nargs="+", type=int, default=[t.id for t in TASKS])
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--out", default=str(HERE / "agent_suite"))
    args = parser.parse_args()
    out = Path(args.out)
    records_path = out.with_suffix(".jsonl")
    records = [json.loads(line) for line in records_path.read_text().splitlines()] if records_path.exists() else []
    by_question = {t.id: t.question for t in TASKS}
    records = [r for r in records if r.get("question") == by_question.get(r["task"])]  # a task changed since: again
    done = {(r["framework"], r["config"], r["task"]) for r in records}
    by_id = {t.id: t for t in TASKS}
    for task_id in args.tasks:
        task = by_id[task_id]
        for framework in args.frameworks:
            for name in args.configs:
                if (framework, name, task.id) in done:
                    continue
                t0 = time.perf_counter()
                run = FRAMEWORKS[framework](task, CONFIGS[name], args.max_tokens)
                run.config, run.seconds = name, round(time.perf_counter() - t0, 1)
                record = {**run.__dict__, **run.judge(task), "two_step": task.two_step, "question": task.question,
                          "max_tokens": args.max_tokens}
                records.append(record)
                with records_path.open("a") as f:
                    f.write(json.dumps(record, default=str) + "\n")
                print(f"[{framework} {name} #{task.id}] finished={record['finished']} stop={run.stop} "
                      f"calls={[(c['name'], c['args'], c['valid']) for c in run.calls]} answer={run.answer[:100]!r} "
                      f"({run.seconds}s)", flush=True)
    summary = summarize(records)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))


if __name__ == "__main__":
    main()
