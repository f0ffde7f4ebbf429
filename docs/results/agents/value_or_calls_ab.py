"""The value-or-calls rule A/B: ``create_agent(chat, tools, response_format=Answer)`` with the rule and without.

Why: with a ``response_format`` next to the tools, the lazy grammar holds a reply before any call to the schema's
value or a call (``ensemble_core.constraints.lazy``, "A value or calls"); without the rule a reply in prose, or one
that writes the schema back, is answered again in a turn of its own (``settle``). This runs each task with the rule
and without it, back to back (interleaved, so the machine's state is shared), and records per run: whether the
answer parsed and holds the tool's result, the calls, the model turns, the answer turns that had to be asked for,
and the seconds. One JSON line per run on stdout:

    .venv/bin/python docs/results/agents/value_or_calls_ab.py safe,single 1,4,8,13,18,19,21,23

A third argument ``prompt`` A/Bs the answer instructions instead (the rule on in both arms): the system prompt's
"reply in plain text" / "answer in plain text" where a schema is asked for (before) against the value's own
wording (``VALUE_ANSWER_INSTRUCTIONS``, ``NO_TOOL_VALUE``); ``rule`` in the records is then the new wording.
"""
import importlib.util
import json
import sys
import time
from pathlib import Path

import ensemble_core.decoding.view as view
import ensemble_core.serving.runtime as runtime
from ensemble_core.constraints import lazy, structured

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("agent_suite", HERE / "agent_suite.py")
suite = importlib.util.module_from_spec(spec)
sys.modules["agent_suite"] = suite
spec.loader.exec_module(suite)
from langchain.agents import create_agent  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_core.tools import StructuredTool  # noqa: E402
from langchain_ensemble import ChatEnsemble  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


class Answer(BaseModel):
    """The final answer to the user's question."""
    answer: str = Field(description="the answer in one sentence, with the tool's result")


def without_rule(request, messages, exclude_repeated=True, enabled=True):  # noqa: ANN001, ANN201
    """``lazy.lazy_calls`` as before the rule: the calls' grammar only, no value."""
    calls = lazy.lazy_calls(request, messages, exclude_repeated, enabled)
    return None if calls is None else lazy.LazyCalls(calls.tools, calls.forbid, calls.excluded)


answer_turns = [0]
_answered = runtime.answered


def counted(first, answer):  # noqa: ANN001, ANN201
    answer_turns[0] += 1
    return _answered(first, answer)


runtime.answered = counted
configs = sys.argv[1].split(",")
ids = [int(x) for x in sys.argv[2].split(",")]
ab = sys.argv[3] if len(sys.argv) > 3 else "rule"
WORDING = {True: (structured.VALUE_ANSWER_INSTRUCTIONS, structured.NO_TOOL_VALUE),
           False: (structured.ANSWER_INSTRUCTIONS, structured.NO_TOOL_TEXT)}
tasks = {t.id: t for t in suite.TASKS}
chats = {name: ChatEnsemble(members=suite.CONFIGS[name]["members"], method=suite.CONFIGS[name]["method"],
                            max_tokens=80) for name in configs}
for tid in ids:
    task = tasks[tid]
    for name in configs:
        for rule in (True, False):
            if ab == "rule":
                view.lazy_calls = lazy.lazy_calls if rule else without_rule
            else:
                structured.VALUE_ANSWER_INSTRUCTIONS, structured.NO_TOOL_VALUE = WORDING[rule]
            tools = [StructuredTool.from_function(suite.TOOLS[n]) for n in task.toolbox()]
            agent = create_agent(chats[name], tools, response_format=Answer)
            answer_turns[0] = 0
            t, err, state = time.time(), None, {"messages": []}
            try:
                state = agent.invoke({"messages": [HumanMessage(task.question)]}, {"recursion_limit": 8})
            except Exception as e:  # noqa: BLE001 - recorded: the run did not parse
                err = f"{type(e).__name__}: {str(e)[:150]}"
            sr = state.get("structured_response")
            ais = [m for m in state["messages"] if isinstance(m, AIMessage)]
            print(json.dumps({"task": tid, "config": name, "ab": ab, "rule": rule, "parsed": isinstance(sr, Answer),
                              "has_result": bool(sr) and suite.has_result(sr.answer, task.result),
                              "answer": sr.answer if sr else None,
                              "calls": [(c["name"], c["args"]) for m in ais for c in m.tool_calls],
                              "model_turns": len(ais), "answer_turns": answer_turns[0], "error": err,
                              "s": round(time.time() - t, 1)}), flush=True)
