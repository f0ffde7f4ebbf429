"""Record (or check) greedy outputs of every method on the bundled real pair.

Written before the core-shape refactor so that the refactor can be checked byte for byte:
``python tests/golden/record.py`` rewrites ``tests/golden/outputs.json``;
``tests/test_golden.py`` regenerates the same cases and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).parent
OUT = HERE / "outputs.json"

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "Write a Python function that returns the n-th Fibonacci number.",
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Translate to French and German: 'The weather is nice today.' 东京 is a city."}],
]
MAX_NEW_TOKENS = 40

#: The papers' settings: the ensemble cases were recorded before the members' votes were weighted
#: (``reliability="prior"``, the default since: Gemma-3, without a chat template, would weigh a fifth here)
#: and before SAFE's CPU default drafting levers (``prompt_lookup=4``, ``draft_confidence=0.5``).
PUBLISHED = {"published": True}

#: (case name, method, member indices into [smollm2, gemma3], config)
CASES = [
    ("single-smollm2", "single", [0], {}),
    ("single-gemma3", "single", [1], {}),
    ("safe-unite-d0", "safe", [0, 1], {**PUBLISHED}),
    ("safe-unite-d1", "safe", [0, 1], {"drafter": 1, **PUBLISHED}),
    ("safe-gac-d0", "safe", [0, 1], {"distribution": "gac", **PUBLISHED}),
    ("every-token-unite", "every-token", [0, 1], {**PUBLISHED}),
    ("every-token-gac", "every-token", [0, 1], {"distribution": "gac", **PUBLISHED}),
    # recorded when the published reward was the default (it is fixed here so the case stays a refactor check)
    ("specem", "specem", [0, 1], {"parallel": False, "reward": "published", **PUBLISHED}),
    ("generate-then-select", "generate-then-select", [0, 1], {"parallel": False, **PUBLISHED}),
]


def run_case(members: list, method: str, idx: list[int], config: dict, prompt: object) -> dict:
    from ensemble_core import Ensemble

    ens = Ensemble([members[i] for i in idx], method=method, max_new_tokens=MAX_NEW_TOKENS, **config)
    result = ens.generate(prompt)
    return {"text": result.text, "finish_reason": result.finish_reason,
            "completion_tokens": result.completion_tokens}


def load_pair() -> list:
    from ensemble_core import Member

    return [Member.load("smollm2-135m-instruct"), Member.load("gemma3-270m")]


def main() -> None:
    torch.set_num_threads(int(os.environ.get("ENSEMBLE_TEST_THREADS", "1")))
    members = load_pair()
    out = {}
    for name, method, idx, config in CASES:
        out[name] = [run_case(members, method, idx, config, p) for p in PROMPTS]
        print(name, json.dumps(out[name][0]["text"])[:80], file=sys.stderr)
    OUT.write_text(json.dumps({"max_new_tokens": MAX_NEW_TOKENS, "cases": out}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
