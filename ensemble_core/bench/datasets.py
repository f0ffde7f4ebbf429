"""Benchmark datasets, chain-of-thought prompts, answer extraction and scoring.

Two datasets share one harness (:mod:`ensemble_core.bench`):

* ``gsm8k``: the GSM8K test split (grade-school maths word problems, answers ending in
  ``#### N``). A copy ships in ``ensemble_core/bench/data`` (MIT licence) so that the harness
  runs offline; ``ENSEMBLE_GSM8K=/path/test.jsonl`` or ``path=`` reads another copy.
  The bundled 135M/270M models solve almost none of it, which is why there is also
* ``arith``: one-step addition and subtraction word problems with small numbers,
  generated from a fixed seed with exact answers. The bundled models alone land between
  20 % and 80 % on it, so accuracy differences between methods become visible on CPU.

Scoring follows GSM8K practice: an answer is a number; ``The answer is N`` (what the
prompt asks for) is preferred, then ``#### N``, then the last number in the text;
commas, dollar signs, trailing periods and trailing zeros are ignored, and numbers are
compared exactly as decimals.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from ensemble_core.errors import InputError, InvalidOptionError

DATA_DIR = Path(__file__).resolve().parent / "data"
VENDORED_GSM8K = DATA_DIR / "gsm8k_test.jsonl.gz"
GSM8K_ENV = "ENSEMBLE_GSM8K"


@dataclass(frozen=True)
class Problem:
    """One benchmark item: an id, the question, the exact numeric answer as a string."""

    id: str
    question: str
    answer: str
    solution: str = ""


# ---------------------------------------------------------------------------- numbers
#: A number as written in maths text: optional sign and dollar sign, thousands separators
#: (only in groups of three, so "1, 2" is two numbers), optional decimals.
NUMBER_RE = re.compile(r"(?<![\w.])(-?)\$?(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
#: Phrases after which the final answer follows; the first one found wins (GSM8K CoT
#: scoring takes the first "The answer is"), "####" is the reference format.
ANSWER_MARKERS = (
    re.compile(r"####"),
    re.compile(r"the (?:final )?answer is", re.IGNORECASE),
    re.compile(r"\\boxed\{"),
    re.compile(r"\banswer\s*:", re.IGNORECASE),
)
MARKER_WINDOW = 40


def normalize_number(text: str) -> str | None:
    """Canonical form of a written number: ``"$1,234.50"`` → ``"1234.5"``, ``"18.00"`` → ``"18"``.

    Returns None for text that is not a number. Canonical forms compare equal exactly
    when the numbers are equal, so scoring is a string comparison.
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    if s.startswith("--"):
        s = s[2:]
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _numbers(text: str) -> list[tuple[int, str]]:
    """(position, canonical value) of every number in ``text``."""
    found = []
    for m in NUMBER_RE.finditer(text):
        sign = "-" if (m.group(1) or m.group(2)) else ""
        value = normalize_number(sign + m.group(3))
        if value is not None:
            found.append((m.start(), value))
    return found


def extract_answer(text: str) -> str | None:
    """The final numeric answer in a model's output (canonical string), or None.

    The first answer marker (``####``, ``The answer is``, ``\\boxed{``, ``Answer:``) that is
    followed by a number within a few characters on its line decides (the number after the
    last ``=`` when the answer is stated as an equation); without one, the last number in
    the text does (GSM8K's "flexible" extraction).
    """
    if not isinstance(text, str) or not text:
        return None
    hits = []
    for pattern in ANSWER_MARKERS:
        for m in pattern.finditer(text):
            window = text[m.end(): m.end() + MARKER_WINDOW].split("\n", 1)[0] or text[m.end(): m.end() + MARKER_WINDOW]
            # "The answer is 9 - 8 = 1." states its result after the last "=".
            tail = window.rpartition("=")[2] if "=" in window else window
            nums = _numbers(tail) or _numbers(window)
            if nums:
                hits.append((m.start(), nums[0][1]))
                break
    if hits:
        return min(hits)[1]
    nums = _numbers(text)
    return nums[-1][1] if nums else None


def gold_answer(reference: str) -> str:
    """The exact answer of a GSM8K reference solution (the number after ``####``)."""
    _, sep, tail = reference.rpartition("####")
    value = normalize_number(tail) if sep else None
    if value is None:
        raise InputError(f"GSM8K reference has no '#### N' answer: {reference[-80:]!r}")
    return value


def is_correct(prediction: str | None, answer: str) -> bool:
    """Exact numeric match of canonical strings (None is never correct)."""
    if prediction is None:
        return False
    gold = normalize_number(answer)
    return gold is not None and normalize_number(prediction) == gold


def score(output: str, answer: str) -> tuple[str | None, bool]:
    """``(extracted answer, correct)`` for one model output."""
    predicted = extract_answer(output)
    return predicted, is_correct(predicted, answer)


# ---------------------------------------------------------------------------- GSM8K
def gsm8k_path(path: str | os.PathLike | None = None) -> Path:
    """The GSM8K file to read: ``path``, else ``$ENSEMBLE_GSM8K``, else the vendored copy."""
    chosen = Path(path or os.environ.get(GSM8K_ENV) or VENDORED_GSM8K).expanduser()
    if not chosen.is_file():
        raise InputError(f"GSM8K file {chosen} does not exist. Pass path=... or set {GSM8K_ENV} to a test.jsonl file.")
    return chosen


def load_gsm8k(path: str | os.PathLike | None = None) -> list[Problem]:
    """All GSM8K problems of a JSONL file (``question`` / ``answer`` fields; ``.gz`` allowed)."""
    file = gsm8k_path(path)
    opener: Callable[..., Any] = gzip.open if file.suffix == ".gz" else open
    problems = []
    with opener(file, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(Problem(f"gsm8k-{i}", row["question"], gold_answer(row["answer"]), row["answer"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise InputError(f"{file}:{i + 1} is not a GSM8K record ({exc}).") from exc
    return problems


# ---------------------------------------------------------------------------- arith
_NAMES = (("Tom", "he"), ("Anna", "she"), ("Ben", "he"), ("Mia", "she"), ("Sam", "he"), ("Lily", "she"),
          ("Jack", "he"), ("Emma", "she"), ("Leo", "he"), ("Sara", "she"))
_ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "balloons", "cards", "eggs")
_ADD = (
    "{name} has {a} {items}. {Pron} buys {b} more {items}. How many {items} does {name} have now?",
    "There are {a} {items} in a box. {name} puts {b} more {items} in the box. How many {items} are in the box now?",
    "{name} had {a} {items} and got {b} more from a friend. How many {items} does {name} have in total?",
)
_SUB = (
    "{name} has {a} {items}. {Pron} gives {b} {items} to a friend. How many {items} does {name} have left?",
    "There are {a} {items} on a table. {name} takes {b} of them away. How many {items} are left on the table?",
    "{name} had {a} {items} and lost {b} of them. How many {items} does {name} have now?",
)
#: Difficulty used by ``--dataset arith``: chosen so that both bundled models alone score
#: between 20 % and 80 % (measured numbers in docs/benchmarks.md).
ARITH_MAX = 10
ARITH_SEED = 1234
#: Few-shot examples the benchmark uses by default per dataset: the bundled models follow
#: the "a + b = c. The answer is c." format from two examples, and ramble without them.
DEFAULT_SHOTS = {"gsm8k": 0, "arith": 2}


def arith_problems(n: int = 500, seed: int = ARITH_SEED, max_value: int = ARITH_MAX) -> list[Problem]:
    """``n`` one-step addition / subtraction word problems with exact answers.

    Numbers are drawn from ``2..max_value`` under ``seed`` (same seed, same problems, on
    any machine: :class:`random.Random` is stable across Python versions for these
    calls); subtraction never goes below zero.
    """
    if not isinstance(n, int) or n < 1:
        raise InvalidOptionError("n", n, "an integer >= 1")
    if not isinstance(max_value, int) or max_value < 3:
        raise InvalidOptionError("max_value", max_value, "an integer >= 3")
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        name, pron = rng.choice(_NAMES)
        items = rng.choice(_ITEMS)
        a, b = rng.randint(2, max_value), rng.randint(2, max_value)
        if rng.random() < 0.5:
            template, answer, op = rng.choice(_ADD), a + b, "+"
        else:
            a, b = max(a, b), min(a, b)
            template, answer, op = rng.choice(_SUB), a - b, "-"
        question = template.format(name=name, Pron=pron.capitalize(), a=a, b=b, items=items)
        problems.append(Problem(f"arith-{i}", question, str(answer), f"{a} {op} {b} = {answer}.\n#### {answer}"))
    return problems


DATASETS: dict[str, Callable[..., list[Problem]]] = {"gsm8k": load_gsm8k, "arith": arith_problems}


def load_dataset(name: str, limit: int | None = None, offset: int = 0, path: str | os.PathLike | None = None) -> list[Problem]:
    """Problems ``offset .. offset + limit`` of a dataset by name (``gsm8k`` or ``arith``)."""
    if name not in DATASETS:
        raise InvalidOptionError("dataset", name, "one of " + ", ".join(DATASETS))
    if not isinstance(offset, int) or offset < 0:
        raise InvalidOptionError("offset", offset, "an integer >= 0")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise InvalidOptionError("limit", limit, "an integer >= 1 or None")
    if name == "gsm8k":
        problems = load_gsm8k(path)
    else:
        problems = arith_problems(n=offset + (limit or 500))
    end = None if limit is None else offset + limit
    selected = problems[offset:end]
    if not selected:
        raise InputError(f"Dataset {name!r} has {len(problems)} problems; offset {offset} selects none.")
    return selected


# ---------------------------------------------------------------------------- prompts
COT_INSTRUCTION = (
    "Solve the following math problem. Think step by step, then finish with a line "
    "'The answer is N.' where N is the final number."
)


def cot_prompt(question: str, shots: list[Problem] | tuple[Problem, ...] = ()) -> list[dict[str, str]]:
    """Chat messages for a zero- or few-shot chain-of-thought question.

    Few-shot examples are previous user/assistant turns whose answers end with "The answer
    is N." (the reference solution with its calculator annotations ``<<...>>`` removed),
    so that each member's own chat template formats them.
    """
    messages: list[dict[str, str]] = []
    for shot in shots:
        solution = re.sub(r"<<[^>]*>>", "", shot.solution)
        solution = (solution.rpartition("####")[0] if "####" in solution else solution).strip()
        body = (solution + "\n" if solution else "") + f"The answer is {shot.answer}."
        messages.append({"role": "user", "content": f"{COT_INSTRUCTION}\n\nQuestion: {shot.question}"})
        messages.append({"role": "assistant", "content": body})
    messages.append({"role": "user", "content": f"{COT_INSTRUCTION}\n\nQuestion: {question}"})
    return messages
