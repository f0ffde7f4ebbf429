"""``ensemble demo``: the table's helpers (fast, no models) and one real ``--quick`` run (its shape, not its numbers)."""

from __future__ import annotations

import re

import pytest

from ensemble_core import demo
from ensemble_core.bench.datasets import arith_problems, cot_prompt
from ensemble_core.cli import build_parser, main
from ensemble_core.ensemble import Ensemble
from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.bundled import QWEN_ALIAS
from ensemble_core.testing import tiny_member


def _row(label: str, correct: list[bool], tokens: int = 30, seconds: float = 6.0, ensembled: int | None = None,
         answers: list[str | None] | None = None) -> demo.Row:
    answers = answers if answers is not None else ["1" if ok else "9" for ok in correct]
    return demo.Row(label, answers, correct, tokens, seconds, ensembled)


def _table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of each body row of a Markdown table (header and separator dropped)."""
    rows = [line for line in lines if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in rows[1:]]


# ---------------------------------------------------------------------------- pure helpers
def test_questions_are_the_first_of_the_arith_set_with_the_bench_shots() -> None:
    problems, shots = demo.demo_questions(5)
    pool = arith_problems()
    assert problems == pool[:5]
    assert shots == [pool[-1], pool[-2]]  # ensemble bench's rule: from the far end, never overlapping
    assert not {p.id for p in shots} & {p.id for p in problems}
    for bad in (0, 499):
        with pytest.raises(InvalidOptionError, match="--questions"):
            demo.demo_questions(bad)


@pytest.fixture(scope="module")
def tiny_pair() -> list:
    """Random-weight SmolLM2 and Qwen shapes; a wider init than the default so that they write text (as in test_batching)."""
    return [tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2),
            tiny_member(QWEN_ALIAS, seed=0, initializer_range=0.2)]


@pytest.mark.parametrize("batched", [False, True])
def test_rows_from_tiny_members_sequential_and_batched(tiny_pair: list, batched: bool, capsys) -> None:
    """The GPU path (one batch per run) and the CPU path (one question at a time) fill the same row, on CPU."""
    problems, shots = demo.demo_questions(2)
    prompts = [cot_prompt(p.question, shots) for p in problems]
    ensemble = Ensemble(tiny_pair, method="safe", drafter=1, **demo.DEMO_SAFE_CONFIG)
    row, results = demo.run_row(ensemble, "SAFE", prompts, problems, batched)
    assert len(results) == 2 and len(row.answers) == len(row.correct) == 2
    assert row.tokens == sum(r.completion_tokens for r in results) > 0 and row.seconds > 0
    assert row.ensembled is not None and 0 <= row.e_t <= 1
    single, _ = demo.run_row(Ensemble(tiny_pair[:1], method="single"), "tiny alone", prompts[:1], problems[:1], batched)
    assert single.ensembled is None and single.e_t is None and single.tokens > 0
    out = capsys.readouterr().out
    assert ("one batch" in out) == batched and ("[1/2] arith-0 SAFE" in out) != batched


def test_table_has_a_gold_row_and_one_row_per_run() -> None:
    rows = [_row("a alone", [True, False], tokens=40, seconds=4.0, answers=["1", None]), _row("b alone", [True, True]),
            _row("SAFE ensemble", [True, True], tokens=30, seconds=7.5, ensembled=3)]
    cells = _table_rows(demo.format_table(rows, ["1", "2"]))
    assert [c[0] for c in cells] == ["gold", "a alone", "b alone", "SAFE ensemble"]
    assert cells[0][1] == "1 2"
    assert cells[1][1:] == ["1 –", "yes no", "1/2", "40", "4.0", "10.00", "–"]
    assert cells[3][-1] == "10.0%" and cells[3][-2] == "4.00"
    assert all(len(c) == 8 for c in cells)


def test_verdict_says_what_the_table_shows() -> None:
    ids = ["q0", "q1", "q2"]
    weak, strong = _row("weak alone", [True, False, False], seconds=3.0), _row("strong alone", [True, True, True])
    tie = demo.verdict([weak, strong], _row("SAFE", [True, True, True], seconds=6.6), ids)
    assert "3/3, as many as its best member (strong alone: 3/3; weak alone: 1/3)" in tie and "1.10x" in tie
    better = demo.verdict([weak, _row("strong alone", [True, False, True])], _row("SAFE", [True, True, True]), ids)
    assert "more than any member alone" in better
    lost = demo.verdict([weak, strong], _row("SAFE", [True, False, True], answers=["1", "7", "1"]), ids)
    assert "fewer than strong alone" in lost and "q1 (ensemble 7, strong alone 1)" in lost and "fusion_weights" in lost


def test_stream_check_never_calls_a_cut_answer_wrong() -> None:
    assert "correct" in demo.stream_check("12 + 7 - 4 = 15. The answer is 15.", "stop", "15", 96)
    assert "wrong (expected 15)" in demo.stream_check("The answer is 23.", "stop", "15", 96)
    assert "budget" in demo.stream_check("First, 12 + 7 = 19. Then 19 -", "length", "15", 96)
    assert "no reference" in demo.stream_check("The answer is 42.", "stop", None, 96)


def test_drafter_load_notes_and_device() -> None:
    assert demo.drafter_index(demo.DEMO_MEMBERS) == demo.DEMO_MEMBERS.index(QWEN_ALIAS)
    assert demo.drafter_index(["smollm2-135m-instruct", "gemma3-270m"]) == 0
    assert "converting" in demo.load_note(QWEN_ALIAS, True) and "once" in demo.load_note(QWEN_ALIAS, True)
    assert "cache" in demo.load_note(QWEN_ALIAS, False) and demo.load_note("my/model", None) == "loading ..."
    assert demo.on_gpu(["cuda:0"]) and demo.on_gpu(["cpu", "cuda"]) and not demo.on_gpu(None) and not demo.on_gpu(["cpu"])
    assert demo.conversion_pending("not-bundled") is None


def test_demo_flags_and_device_reach_the_members(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    args = build_parser().parse_args(["demo", "--quick", "--device", "cuda", "--dtype", "bfloat16"])
    assert args.quick and args.members is None and args.questions is None and args.device == ["cuda"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--questions", "0"])
    seen: list[dict] = []

    def fake_resolve(items: list[str], **options: object) -> list[object]:
        seen.append({"name": items[0], **options})
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(demo, "resolve_members", fake_resolve)
    monkeypatch.setattr(demo, "conversion_pending", lambda name: False)
    with pytest.raises(RuntimeError, match="stop before loading"):
        demo.run_demo(build_parser().parse_args(["demo", "--device", "cuda:1", "--dtype", "bfloat16"]), lambda stats: [])
    # timed rows share members: no prefix cache, or the second row to run a prompt would find it prefilled
    assert seen == [{"name": demo.DEMO_MEMBERS[0], "device": "cuda:1", "dtype": "bfloat16", "prefix_cache": 0}]
    assert f"on {demo.GPU_QUESTIONS} fixed arithmetic questions" in capsys.readouterr().out


# ---------------------------------------------------------------------------- a real run
@pytest.mark.real
def test_quick_demo_prints_a_table_of_real_runs(capsys) -> None:
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "loading" in out and "Warming up" in out  # no silent wait
    cells = _table_rows(out.splitlines())
    labels = [c[0] for c in cells]
    assert labels == ["gold", *(f"{name} alone" for name in demo.DEMO_MEMBERS),
                      f"SAFE ensemble ({QWEN_ALIAS} drafting)"]
    for row in cells[1:]:
        _, answers, correct, score, tokens, seconds, per_second, e_t = row
        assert correct in ("yes", "no") and score in ("0/1", "1/1") and len(answers.split()) == 1
        assert int(tokens) > 0 and float(seconds) > 0 and float(per_second) > 0
    assert [c[-1] for c in cells[1:3]] == ["–", "–"] and re.fullmatch(r"\d+\.\d%", cells[3][-1])
    assert "The ensemble answered" in out
    # the ensemble's own answer to the question, with its SAFE statistics
    assert "E/T (ensembled / total tokens)" in out and "accepted:" in out and "(drafter):" in out
    assert "Total demo time" in out and "\ufffd" not in out

