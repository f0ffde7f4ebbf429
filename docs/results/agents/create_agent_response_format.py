"""LangChain 1.x ``create_agent(chat, tools, response_format=Answer)`` over agent-suite tasks: does the answer parse?

Why: with a ``response_format``, ``create_agent`` binds the schema next to the tools on every model call
(its ``ProviderStrategy``, since ``ChatEnsemble.profile`` says it supports structured output). In such a
turn the grammar guards the calls; a reply that ends in a repeated call, or holds no call and is not a
value of the schema, is answered again under the schema's grammar (``tool_choice="none"``). This counts
how often the final answer parses and carries the tool's result. One JSON line per run on stdout:

    .venv/bin/python docs/results/agents/create_agent_response_format.py safe,single 1,4,8,13,18,19,21,23
"""
import importlib.util
import json
import sys
import time
from pathlib import Path

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

from ensemble_core.serving import runtime  # noqa: E402


class Answer(BaseModel):
    """The final answer to the user's question."""
    answer: str = Field(description="the answer in one sentence, with the tool's result")

class AnswerTurns:
    """Counts the answer turns the runtime asks for (``runtime.answered``) from its creation on; ``count = 0`` resets."""

    def __init__(self) -> None:
        self.count = 0
        self._answered = runtime.answered
        runtime.answered = self._counted

    def _counted(self, first, answer):  # noqa: ANN001, ANN202
        self.count += 1
        return self._answered(first, answer)


def run(chat: ChatEnsemble, task: "suite.Task") -> dict:
    """One ``create_agent(chat, task's tools, response_format=Answer)`` run of ``task``: its record."""
    tools = [StructuredTool.from_function(suite.TOOLS[n]) for n in task.toolbox()]
    agent = create_agent(chat, tools, response_format=Answer)
    t, err, state = time.time(), None, {"messages": []}
    try:
        state = agent.invoke({"messages": [HumanMessage(task.question)]}, {"recursion_limit": 8})
    except Exception as e:  # noqa: BLE001 - recorded: the run did not parse
        err = f"{type(e).__name__}: {str(e)[:150]}"
    sr = state.get("structured_response")
    ais = [m for m in state["messages"] if isinstance(m, AIMessage)]
    return {"task": task.id, "parsed": isinstance(sr, Answer),
            "has_result": bool(sr) and suite.has_result(sr.answer, task.result),
            "answer": sr.answer if sr else None, "last": str(ais[-1].content)[:100] if ais else None,
            "calls": [(c["name"], c["args"]) for m in ais for c in m.tool_calls],
            "repeats": [len(m.response_metadata.get("repeated_tool_calls", [])) for m in ais],
            "model_turns": len(ais), "error": err, "s": round(time.time() - t, 1)}


if __name__ == "__main__":
    configs = sys.argv[1].split(",")
    ids = [int(x) for x in sys.argv[2].split(",")]
    tasks = {t.id: t for t in suite.TASKS}
    for tid in ids:
        for name in configs:
            cfg = suite.CONFIGS[name]
            chat = ChatEnsemble(members=cfg["members"], method=cfg["method"], max_tokens=80)
            print(json.dumps({"config": name, **run(chat, tasks[tid])}), flush=True)
