"""LlamaIndex structured output, as a schema's value or as a forced call: which fills the fields right?

``EnsembleLLM.structured_predict`` (and ``as_structured_llm``, and ``FunctionAgent(output_cls=...)``, which
calls it on the agent's conversation) either decodes the answer as the output class's JSON value under its
schema (``pydantic_program_mode="default"``, the library's default) or goes through LlamaIndex's
``FunctionCallingProgram``: a forced call of a tool named after the class (``"function"``). Paired and
interleaved, the same members and prompts in both modes (greedy), on two sets:

* ``agent``: agent-suite tasks through ``FunctionAgent`` (no ``output_cls``), then LlamaIndex's own
  ``generate_structured_response`` (what ``output_cls`` runs) on the agent's final conversation, once per
  mode, into ``Answer(answer: str)``; right when the answer holds the tool's result;
* ``extract``: 16 sentences with known fields into ``Person(name, age, city)`` or
  ``Order(item, quantity, unit_price)`` through ``structured_predict``; right per field and per sentence.

One JSON line per measurement on stdout, a summary on stderr::

    .venv/bin/python docs/results/agents/llamaindex_structured.py --configs safe single --tasks 1 4 8 13 18 19 21 23
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from llama_index.core.agent.utils import generate_structured_response
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.ensemble import EnsembleLLM
from pydantic import BaseModel, Field

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("agent_suite", HERE / "agent_suite.py")
suite = importlib.util.module_from_spec(spec)
sys.modules["agent_suite"] = suite
spec.loader.exec_module(suite)

MODES = ("default", "function")


class Answer(BaseModel):
    """The final answer to the user's question."""

    answer: str = Field(description="the answer in one sentence, with the tool's result")


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int
    city: str


class Order(BaseModel):
    """One line of an order."""

    item: str = Field(description="what is ordered")
    quantity: int
    unit_price: float = Field(description="the price of one item")


PEOPLE = [
    ("Tom, 52, lives in Boston.", ("Tom", 52, "Boston")),
    ("Maria Lopez is a 34-year-old nurse from Madrid.", ("Maria Lopez", 34, "Madrid")),
    ("Born 27 years ago, Kenji now works in Osaka.", ("Kenji", 27, "Osaka")),
    ("After moving to Toronto, 45-year-old Priya Shah opened a bakery.", ("Priya Shah", 45, "Toronto")),
    ("Lukas (19) studies physics in Berlin.", ("Lukas", 19, "Berlin")),
    ("The mayor of Lyon, Claire Martin, turned 61 this week.", ("Claire Martin", 61, "Lyon")),
    ("Ahmed is 38 and has lived in Cairo all his life.", ("Ahmed", 38, "Cairo")),
    ("Sofia, a retired teacher aged 70, spends her days in Lisbon.", ("Sofia", 70, "Lisbon")),
]
ORDERS = [  # the item is right when it contains the word (notebook / notebooks)
    ("I'd like 3 notebooks at 2.50 each.", ("notebook", 3, 2.5)),
    ("Please send 12 pencils; they cost 0.40 per piece.", ("pencil", 12, 0.4)),
    ("Order: 2 desk lamps, 19.99 apiece.", ("lamp", 2, 19.99)),
    ("We bought five chairs for 45 dollars each.", ("chair", 5, 45.0)),
    ("Add 1 monitor priced at 189.00 to the cart.", ("monitor", 1, 189.0)),
    ("Ten boxes of tea, 4.25 per box.", ("tea", 10, 4.25)),
    ("Get me 6 bottles of water at 0.99 a bottle.", ("water", 6, 0.99)),
    ("The invoice lists 4 keyboards at 35.50 each.", ("keyboard", 4, 35.5)),
]


def field_right(got: Any, want: Any, contains: bool = False) -> bool:
    if isinstance(want, str):
        g, w = str(got).strip().lower(), want.lower()
        return w in g if contains else g == w
    try:
        return abs(float(got) - float(want)) < 1e-6
    except (TypeError, ValueError):
        return False


def llm_for(config: dict[str, Any], mode: str) -> EnsembleLLM:
    return EnsembleLLM(members=config["members"], method=config["method"], max_new_tokens=80,
                       pydantic_program_mode=mode)


async def agent_set(configs: list[str], task_ids: list[int]) -> list[dict[str, Any]]:
    tasks = {t.id: t for t in suite.TASKS}
    out = []
    for k, tid in enumerate(task_ids):
        task = tasks[tid]
        for name in configs:
            config = suite.CONFIGS[name]
            agent = FunctionAgent(tools=[FunctionTool.from_defaults(suite.TOOLS[n]) for n in task.toolbox()],
                                  llm=llm_for(config, "default"))
            handler = agent.run(task.question, max_iterations=4)
            await handler
            messages = await (await handler.ctx.store.get("memory")).aget()
            for mode in (MODES if k % 2 == 0 else MODES[::-1]):  # interleaved: who goes first alternates
                t, error, value = time.time(), None, None
                try:
                    value = await generate_structured_response(messages, llm_for(config, mode), Answer)
                except Exception as e:  # noqa: BLE001 - recorded: the value did not come
                    error = f"{type(e).__name__}: {str(e)[:150]}"
                answer = (value or {}).get("answer")
                record = {"set": "agent", "task": tid, "config": name, "mode": mode, "parsed": value is not None,
                          "right": bool(answer) and suite.has_result(answer, task.result), "answer": answer,
                          "error": error, "s": round(time.time() - t, 2)}
                print(json.dumps(record), flush=True)
                out.append(record)
    return out


def extraction(llm: EnsembleLLM, cls: type, prompt: PromptTemplate, text: str, gold: tuple) -> dict[str, Any]:
    """One ``structured_predict`` of ``text`` into ``cls``, judged field by field against ``gold``."""
    t, error, value = time.time(), None, None
    try:
        value = llm.structured_predict(cls, prompt, text=text)
    except Exception as e:  # noqa: BLE001 - recorded: the value did not come
        error = f"{type(e).__name__}: {str(e)[:150]}"
    got = list(value.model_dump().values()) if value is not None else [None] * len(gold)
    fields = [field_right(g, w, contains=(cls is Order and i == 0)) for i, (g, w) in enumerate(zip(got, gold))]
    return {"text": text, "parsed": value is not None, "fields_right": sum(fields), "fields": len(fields),
            "right": all(fields), "value": got, "error": error, "s": round(time.time() - t, 2)}


def extract_set(configs: list[str]) -> list[dict[str, Any]]:
    prompt = PromptTemplate("Extract the details from this text: {text}")
    items = [(Person, text, gold) for text, gold in PEOPLE] + [(Order, text, gold) for text, gold in ORDERS]
    out = []
    for k, (cls, text, gold) in enumerate(items):
        for name in configs:
            for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                record = {"set": "extract", "config": name, "mode": mode,
                          **extraction(llm_for(suite.CONFIGS[name], mode), cls, prompt, text, gold)}
                print(json.dumps(record), flush=True)
                out.append(record)
    return out


def summary(records: list[dict[str, Any]]) -> None:
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        rows[(r["set"], r["config"], r["mode"])].append(r)
    for (kind, config, mode), group in sorted(rows.items()):
        fields = (f", fields {sum(r['fields_right'] for r in group)}/{sum(r['fields'] for r in group)}"
                  if kind == "extract" else "")
        print(f"{kind} {config} {mode}: right {sum(r['right'] for r in group)}/{len(group)}, parsed "
              f"{sum(r['parsed'] for r in group)}/{len(group)}{fields}, {sum(r['s'] for r in group):.1f} s",
              file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["safe", "single"])
    parser.add_argument("--tasks", nargs="+", type=int, default=[1, 4, 8, 13, 18, 19, 21, 23])
    parser.add_argument("--sets", nargs="+", default=["extract", "agent"], choices=["extract", "agent"])
    args = parser.parse_args()
    records = []
    if "extract" in args.sets:
        records += extract_set(args.configs)
    if "agent" in args.sets:
        records += asyncio.run(agent_set(args.configs, args.tasks))
    summary(records)


if __name__ == "__main__":
    main()
