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
from pathlib import Path

import ensemble_core.decoding.view as view
from ensemble_core.constraints import lazy, structured

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("create_agent_response_format", HERE / "create_agent_response_format.py")
runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runs)  # loads the agent suite too (its tasks, tools and configurations)
suite = runs.suite
from langchain_ensemble import ChatEnsemble  # noqa: E402


def without_rule(request, messages, exclude_repeated=True, enabled=True):  # noqa: ANN001, ANN201
    """``lazy.lazy_calls`` as before the rule: the calls' grammar only, no value."""
    calls = lazy.lazy_calls(request, messages, exclude_repeated, enabled)
    return None if calls is None else lazy.LazyCalls(calls.tools, calls.forbid, calls.excluded)


answer_turns = runs.AnswerTurns()
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
            answer_turns.count = 0
            record = runs.run(chats[name], task)
            print(json.dumps({"config": name, "ab": ab, "rule": rule, **record, "answer_turns": answer_turns.count}),
                  flush=True)
