"""Datasets, answer extraction and scoring as GSM8K scoring expects (pure, fast)."""

from __future__ import annotations

import gzip
import json

import pytest

from ensemble_core.bench.datasets import (
    ARITH_MAX,
    COT_INSTRUCTION,
    Problem,
    arith_problems,
    cot_prompt,
    extract_answer,
    gold_answer,
    is_correct,
    load_dataset,
    load_gsm8k,
    normalize_number,
    score,
)
from ensemble_core.errors import InputError, InvalidOptionError


@pytest.mark.parametrize("text, expected", [
    ("18", "18"), ("1,234", "1234"), ("$1,234.50", "1234.5"), ("18.00", "18"), ("0.50", "0.5"),
    ("-7", "-7"), ("-$7", "-7"), ("$-7", "-7"), (" 42. ", "42"), (".5", "0.5"), ("1,000,000", "1000000"),
    ("abc", None), ("", None), ("nan", None), ("inf", None),
])
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize("output, expected", [
    # the prompt's own format, with the usual decorations
    ("Step 1: 16 - 3 - 4 = 9. Step 2: 9 * 2 = 18.\nThe answer is 18.", "18"),
    ("The answer is $1,234.50.", "1234.5"),
    ("So she pays 3 dollars.\nThe final answer is: **-5**", "-5"),
    ("The answer is 18.00", "18"),
    ("The answer is 0.75 of the cake", "0.75"),
    ("Leo had 9 pencils and lost 8.\nThe answer is 9 - 8 = 1.", "1"),
    ("The answer is: 3 * $4 = $12 in total", "12"),
    # the reference format
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n#### 18", "18"),
    ("#### 1,000", "1000"),
    ("so the total is \\boxed{72}", "72"),
    ("Answer: 12", "12"),
    # the first marker wins over a rambling continuation
    ("The answer is 5.\nUser: what about 7? The answer is 7.", "5"),
    # no marker: the last number (flexible extraction), without mistaking "16-3" for -3
    ("16-3-4=9 eggs, times $2 makes $18", "18"),
    ("He had 5 - 3 = 2 left", "2"),
    ("The temperature dropped to -4 degrees", "-4"),
    ("It costs $.5 each", "0.5"),
    ("Lists like 1, 2, 3 are three numbers", "3"),
    # a marker without a number nearby falls back to the last number
    ("The answer is unclear, but maybe 12", "12"),
    ("no number here", None),
    ("", None),
])
def test_extract_answer(output: str, expected: str | None) -> None:
    assert extract_answer(output) == expected


def test_gold_answer_and_scoring() -> None:
    assert gold_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert gold_answer("#### 1,080") == "1080"
    assert gold_answer("#### -3") == "-3"
    with pytest.raises(InputError):
        gold_answer("no final answer")
    assert is_correct("18.0", "18") and is_correct("1,080", "1080") and not is_correct("17", "18")
    assert not is_correct(None, "18")
    assert score("The answer is $18.", "18") == ("18", True)
    assert score("The answer is 19.", "18") == ("19", False)
    assert score("I do not know.", "18") == (None, False)


def test_vendored_gsm8k_matches_reference_format() -> None:
    problems = load_gsm8k()
    assert len(problems) == 1319
    first = problems[0]
    assert first.id == "gsm8k-0" and first.answer == "18" and first.question.startswith("Janet")
    assert all(p.answer == normalize_number(p.answer) for p in problems)
    assert {"-10", "-3"} <= {p.answer for p in problems if p.answer.startswith("-")}


def test_gsm8k_from_path_env_and_errors(tmp_path, monkeypatch) -> None:
    rows = [{"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"}, {"question": "Q2?", "answer": "#### 1,500"}]
    plain = tmp_path / "test.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    packed = tmp_path / "test.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as fh:
        fh.write(plain.read_text(encoding="utf-8"))
    assert [p.answer for p in load_gsm8k(plain)] == ["2", "1500"]
    assert [p.answer for p in load_gsm8k(packed)] == ["2", "1500"]
    monkeypatch.setenv("ENSEMBLE_GSM8K", str(plain))
    assert [p.question for p in load_dataset("gsm8k", limit=1, offset=1)] == ["Q2?"]
    with pytest.raises(InputError, match="does not exist"):
        load_gsm8k(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "Q"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="bad.jsonl:1"):
        load_gsm8k(bad)


def test_arith_is_deterministic_and_exact() -> None:
    a, b = arith_problems(200), arith_problems(200)
    assert a == b and arith_problems(5, seed=1) != a[:5]
    for p in a:
        nums = [int(x) for x in p.question.split() if x.isdigit()]
        assert len(nums) == 2 and all(2 <= n <= ARITH_MAX for n in nums)
        assert int(p.answer) in (nums[0] + nums[1], nums[0] - nums[1]) and int(p.answer) >= 0
        assert gold_answer(p.solution) == p.answer and extract_answer(p.solution) == p.answer
    assert {"more", "left"} <= {w.strip("?.") for p in a for w in p.question.split()}
    with pytest.raises(InvalidOptionError):
        arith_problems(0)


def test_load_dataset_selection_and_errors() -> None:
    assert [p.id for p in load_dataset("arith", limit=3, offset=2)] == ["arith-2", "arith-3", "arith-4"]
    assert load_dataset("arith", limit=2) == arith_problems(2)
    assert [p.id for p in load_dataset("gsm8k", limit=2, offset=10)] == ["gsm8k-10", "gsm8k-11"]
    with pytest.raises(InvalidOptionError):
        load_dataset("mmlu")
    with pytest.raises(InvalidOptionError):
        load_dataset("gsm8k", limit=0)
    with pytest.raises(InvalidOptionError):
        load_dataset("gsm8k", offset=-1)
    with pytest.raises(InputError, match="selects none"):
        load_dataset("gsm8k", offset=5000)


def test_cot_prompt_zero_and_few_shot() -> None:
    zero = cot_prompt("What is 2 + 3?")
    assert zero == [{"role": "user", "content": f"{COT_INSTRUCTION}\n\nQuestion: What is 2 + 3?"}]
    shot = Problem("s", "Q?", "18", "She makes 9 * 2 = $<<9*2=18>>18.\n#### 18")
    few = cot_prompt("What is 2 + 3?", [shot])
    assert [m["role"] for m in few] == ["user", "assistant", "user"]
    assert few[1]["content"] == "She makes 9 * 2 = $18.\nThe answer is 18."
    assert extract_answer(few[1]["content"]) == "18"
    arith_shot = arith_problems(1)[0]
    first_line = arith_shot.solution.split("\n")[0]
    assert cot_prompt("Q", [arith_shot])[1]["content"] == f"{first_line}\nThe answer is {arith_shot.answer}."
