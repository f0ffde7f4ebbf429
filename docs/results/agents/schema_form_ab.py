"""The schema as a form: a ``response_format`` shown to the members as its JSON Schema, or as the value it asks for.

Why: the system prompt carried the schema itself (``Answer with one JSON object that matches this JSON
Schema, and nothing else: {"description": ..., "properties": {...}}``); Qwen2.5-Coder-0.5B took it for one
more tool or wrote it back. Now it carries the value's form (``{"answer": "<the answer in one sentence,
...>"}``, ``ensemble_core.constraints.schemas.schema_sketch``). The grammar holds the value to the schema
either way; this measures what the members write inside it. Arms interleaved, who goes first alternating:

* ``agent``: ``create_agent(chat, tools, response_format=Answer)`` on the agent suite's single-tool tasks
  (``create_agent_response_format.run``): parsed, the tool's result in the answer, answer turns asked for;
* ``extract``: LlamaIndex ``structured_predict`` of the 16 sentences of ``llamaindex_structured.py`` into
  ``Person`` / ``Order``: right fields;
* ``numeric``: the suite's 13 single-tool tasks with a number for a result through LlamaIndex's
  ``FunctionAgent`` (no ``output_cls``), then LlamaIndex's ``generate_structured_response`` (what
  ``output_cls`` runs) over the agent's conversation into ``Result(value: float, explanation: str)``, once
  per arm: right when ``value`` is the tool's result.

One JSON line per run on stdout, a summary on stderr::

    .venv/bin/python docs/results/agents/schema_form_ab.py safe,single agent,extract,numeric
"""
import asyncio
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from ensemble_core.constraints import structured

HERE = Path(__file__).resolve().parent


def _load(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


runs = _load("create_agent_response_format")  # loads the agent suite too
extract = _load("llamaindex_structured")
suite = runs.suite
from langchain_ensemble import ChatEnsemble  # noqa: E402
from llama_index.core import PromptTemplate  # noqa: E402
from llama_index.core.agent.utils import generate_structured_response  # noqa: E402
from llama_index.core.agent.workflow import FunctionAgent  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


class Result(BaseModel):
    """The result of the user's question and one sentence about it."""

    value: float = Field(description="the result")
    explanation: str


def as_schema(schema: dict) -> str:
    """The instruction before: the JSON Schema itself."""
    return ("Answer with one JSON object that matches this JSON Schema, and nothing else:\n"
            + json.dumps(schema, ensure_ascii=False))


ARMS = {"schema": as_schema, "form": structured.schema_instructions}
answer_turns = runs.AnswerTurns()


def arms_in_turn(k: int) -> list[str]:
    return list(ARMS) if k % 2 == 0 else list(ARMS)[::-1]


def agent(configs: list[str]) -> list[dict]:
    chats = {n: ChatEnsemble(members=suite.CONFIGS[n]["members"], method=suite.CONFIGS[n]["method"], max_tokens=80)
             for n in configs}
    out = []
    for k, task in enumerate(t for t in suite.TASKS if not t.two_step):
        for name in configs:
            for arm in arms_in_turn(k):
                structured.schema_instructions = ARMS[arm]
                answer_turns.count = 0
                record = {"set": "agent", "config": name, "arm": arm, **runs.run(chats[name], task),
                          "answer_turns": answer_turns.count}
                record["right"] = record["has_result"]
                print(json.dumps(record), flush=True)
                out.append(record)
    return out


def extraction(configs: list[str]) -> list[dict]:
    prompt = PromptTemplate("Extract the details from this text: {text}")
    items = [(extract.Person, t, g) for t, g in extract.PEOPLE] + [(extract.Order, t, g) for t, g in extract.ORDERS]
    llms = {n: extract.llm_for(suite.CONFIGS[n], "default") for n in configs}
    out = []
    for k, (cls, text, gold) in enumerate(items):
        for name in configs:
            for arm in arms_in_turn(k):
                structured.schema_instructions = ARMS[arm]
                record = {"set": "extract", "config": name, "arm": arm,
                          **extract.extraction(llms[name], cls, prompt, text, gold)}
                print(json.dumps(record), flush=True)
                out.append(record)
    return out


async def numeric(configs: list[str]) -> list[dict]:
    tasks = [t for t in suite.TASKS if not t.two_step and isinstance(t.result, (int, float))]
    llms = {n: extract.llm_for(suite.CONFIGS[n], "default") for n in configs}
    out = []
    for k, task in enumerate(tasks):
        for name in configs:
            structured.schema_instructions = ARMS["form"]  # the agent's own turns: no schema in them
            agent = FunctionAgent(tools=[FunctionTool.from_defaults(suite.TOOLS[n]) for n in task.toolbox()],
                                  llm=llms[name])
            handler = agent.run(task.question, max_iterations=4)
            await handler
            messages = await (await handler.ctx.store.get("memory")).aget()
            for arm in arms_in_turn(k):
                structured.schema_instructions = ARMS[arm]
                t, error, value = time.time(), None, None
                try:
                    value = await generate_structured_response(messages, llms[name], Result)
                except Exception as e:  # noqa: BLE001 - recorded: the value did not come
                    error = f"{type(e).__name__}: {str(e)[:150]}"
                got = (value or {}).get("value")
                record = {"set": "numeric", "config": name, "arm": arm, "task": task.id, "parsed": value is not None,
                          "right": got is not None and abs(float(got) - float(task.result)) < 1e-6, "value": value,
                          "error": error, "s": round(time.time() - t, 2)}
                print(json.dumps(record), flush=True)
                out.append(record)
    return out


def summary(records: list[dict]) -> None:
    rows = defaultdict(list)
    for r in records:
        rows[(r["set"], r["config"], r["arm"])].append(r)
    for (kind, config, arm), group in sorted(rows.items()):
        more = {"extract": f", fields {sum(r.get('fields_right', 0) for r in group)}/"
                           f"{sum(r.get('fields', 0) for r in group)}",
                "agent": f", answer turns {sum(r.get('answer_turns', 0) for r in group)}"}.get(kind, "")
        print(f"{kind} {config} {arm}: right {sum(r['right'] for r in group)}/{len(group)}, parsed "
              f"{sum(r['parsed'] for r in group)}/{len(group)}{more}, {sum(r['s'] for r in group):.1f} s",
              file=sys.stderr)


if __name__ == "__main__":
    configs = sys.argv[1].split(",")
    sets = sys.argv[2].split(",") if len(sys.argv) > 2 else ["agent", "extract", "numeric"]
    records = ((agent(configs) if "agent" in sets else []) + (extraction(configs) if "extract" in sets else [])
               + (asyncio.run(numeric(configs)) if "numeric" in sets else []))
    summary(records)
