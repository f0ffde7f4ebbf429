"""``ensemble demo`` (``./dev demo``): what an ensemble is for, measured on a fixed set of questions.

What it runs, chosen before any answer was looked at:

* **Questions**: the first :data:`CPU_QUESTIONS` questions of the ``arith`` set
  (:func:`~ensemble_core.bench.datasets.arith_problems`, seed 1234: the benchmark's held-out
  one-step arithmetic word problems), prompted exactly as ``ensemble bench --dataset arith``
  does (chain of thought, two shots from the far end of the set, 48 new tokens, stop at
  ``"\\nQuestion:"``, greedy), scored by the benchmark's own answer extraction
  (:func:`~ensemble_core.bench.datasets.score`). ``--quick`` asks the first question only; on a
  GPU (``--device cuda``) the first :data:`GPU_QUESTIONS`, each row as one batch.
* **Members**: the "Qwen pair", SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct, the two
  bundled members that can do this task at all (Gemma-3-270m is a base model without a chat
  template). The ensemble is SAFE with Qwen drafting and its default settings, which on a CPU
  are the two drafting levers the project measured as its cheapest setting (``prompt_lookup=4``,
  ``draft_confidence=0.5``: docs/configuration.md, "Published and measured defaults").
  What the project measured beforehand (docs/benchmarks.md, "arith, 20 questions"): Qwen alone
  100 %, SmolLM2 alone 50 %, every Qwen-pair ensemble 100 %. So the point the demo can make
  here is that the ensemble keeps the strong member's answers where the weak one fails, at
  about the strong one's cost; it cannot beat a member that is already always right.

Whatever the run shows is printed as it is: the table, and a note that says whether the
ensemble matched its best member and, if not, on which questions it lost. Then the ensemble
streams one answer with its statistics, as the demo always did: the farmer question (or
``--question``), zero-shot chain of thought, now with the benchmark's zero-shot budget of
:data:`STREAM_TOKENS` tokens (Qwen's chain of thought for it is ~130-150 tokens: the old 96
cut it before its answer). This answer is a showcase of streaming and of SAFE's statistics,
not a measurement: the table is. (Tried while building this demo: in the table's two-shot
format the ensemble answered "12 + 7 = 29" where Qwen alone answered 15 and SmolLM2 20, a
fusion of the two members' digits. Zero-shot, the format the demo has always used, is kept.)

Every step that can take a while (a first-time GGUF conversion, loading, the first passes
of a fresh process) says so on screen before it starts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ensemble_core.bench.datasets import ARITH_SEED, Problem, arith_problems, cot_prompt, extract_answer, score
from ensemble_core.ensemble import Ensemble, resolve_members
from ensemble_core.errors import EnsembleError, InvalidOptionError
from ensemble_core.flags import member_options
from ensemble_core.models.bundled import BUNDLED, QWEN_ALIAS, converted_dir

DEMO_MEMBERS = ("smollm2-135m-instruct", QWEN_ALIAS)
#: SAFE out of the box: its defaults, which on a CPU are the measured drafting levers (``prompt_lookup=4``,
#: ``draft_confidence=0.5``; docs/configuration.md, "Published and measured defaults").
DEMO_SAFE_CONFIG: dict[str, Any] = {}
CPU_QUESTIONS = 5
GPU_QUESTIONS = 20
#: As ``ensemble bench --dataset arith``: two shots, 48 new tokens, the bench's stop string.
SHOTS = 2
TABLE_TOKENS = 48
STOP = ("\nQuestion:",)
#: The question the demo streams at the end unless ``--question`` is given, and its answer.
STREAM_QUESTION = "A farmer has 12 cows. He buys 7 more cows and then sells 4. How many cows does the farmer have now?"
STREAM_ANSWER = "15"
#: ``ensemble bench``'s budget for zero-shot chain of thought (GSM8K): room for the reasoning and its last line.
STREAM_TOKENS = 256
WARMUP_PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
#: How long the one-time GGUF -> safetensors conversion took on a 2-core CPU (docs/benchmarks.md: Qwen 115 s).
CONVERSION_ESTIMATE = {"smollm2-135m-instruct": "under a minute", "gemma3-270m": "about a minute",
                       QWEN_ALIAS: "about 2 minutes"}


# ---------------------------------------------------------------------------- pure helpers
@dataclass
class Row:
    """One line of the table: a member alone or the ensemble, over the demo's questions."""

    label: str
    answers: list[str | None] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    ensembled: int | None = None  # token-level methods only (E/T = ensembled / tokens)

    @property
    def score(self) -> int:
        return sum(self.correct)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def e_t(self) -> float | None:
        return None if self.ensembled is None or not self.tokens else self.ensembled / self.tokens


def add_result(row: Row, result: Any, answer: str) -> None:
    """Score one :class:`~ensemble_core.GenerationResult` with the benchmark's extraction and add it to ``row``."""
    predicted, ok = score(result.text, answer)
    row.answers.append(predicted)
    row.correct.append(ok)
    row.tokens += result.completion_tokens
    if "ensembled" in result.stats:
        row.ensembled = (row.ensembled or 0) + int(result.stats["ensembled"])


def demo_questions(count: int) -> tuple[list[Problem], list[Problem]]:
    """The first ``count`` arith questions and the two shots, picked as ``ensemble bench`` picks them.

    The shots come from the far end of the 500-question set and never overlap the questions,
    so the prompts are the benchmark's prompts and the project's arith numbers apply.
    """
    pool = arith_problems(seed=ARITH_SEED)
    if not isinstance(count, int) or not 1 <= count <= len(pool) - SHOTS:
        raise InvalidOptionError("--questions", count, f"an integer from 1 to {len(pool) - SHOTS}, e.g. --questions 5")
    chosen = pool[:count]
    ids = {p.id for p in chosen}
    shots = [p for p in reversed(pool) if p.id not in ids][:SHOTS]
    return chosen, shots


def drafter_index(names: Sequence[str]) -> int:
    """SAFE's drafter: Qwen when it is a member (the strong member drafts, the measured best setting), else the first."""
    return list(names).index(QWEN_ALIAS) if QWEN_ALIAS in names else 0


def on_gpu(devices: Sequence[str] | None) -> bool:
    """Whether ``--device`` puts any member on a CUDA device (then more questions, batched)."""
    return any(str(d).startswith("cuda") for d in devices or ())


def load_note(name: str, pending: bool | None) -> str:
    """What the user waits for while ``name`` loads: a one-time conversion (minutes) or a cache read (seconds)."""
    if pending:
        estimate = CONVERSION_ESTIMATE.get(name, "a few minutes")
        return (f"converting its GGUF file once into a safetensors cache ({estimate}; "
                "later runs load it in seconds) ...")
    if pending is None:
        return "loading ..."
    return "loading from the converted cache (seconds) ..."


def conversion_pending(name: str) -> bool | None:
    """Whether loading bundled model ``name`` first converts its GGUF file (None: not bundled, or unknown).

    Locating Qwen's or Gemma-3's GGUF file assembles it from its packages the first time
    (a few seconds); a missing package is left to the load, which names the install command.
    """
    bundled = BUNDLED.get(name)
    if bundled is None:
        return None
    try:
        gguf = bundled.locate()
    except EnsembleError:
        return None
    return not (converted_dir(gguf) / "config.json").exists()


def stream_check(text: str, finish_reason: str, reference: str | None, budget: int) -> str:
    """How the streamed answer did, in words: right or wrong against ``reference``, or cut by the token budget
    (then the last number in the text is no final answer, and saying "wrong" would blame the model for the cap)."""
    if finish_reason == "length" and "answer is" not in text.lower():
        return f"; cut at the {budget}-token budget before a final answer (--max-new-tokens raises it)"
    if reference is None:
        return f"; answer {_cell(extract_answer(text))} (no reference answer for a custom --question)"
    predicted, ok = score(text, reference)
    return f"; answer {_cell(predicted)}: " + ("correct" if ok else f"wrong (expected {reference})")


def _cell(value: str | None) -> str:
    return "–" if value is None else value


def format_table(rows: Sequence[Row], gold: Sequence[str]) -> list[str]:
    """The result table as Markdown lines: one row per run, answers next to the gold answers."""
    header = ["run", "answers", "correct", "score", "tokens", "seconds", "tokens/s", "E/T"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.append("| gold | " + " ".join(gold) + " | | | | | | |")
    for row in rows:
        e_t = "–" if row.e_t is None else f"{row.e_t:.1%}"
        cells = [row.label, " ".join(_cell(a) for a in row.answers), " ".join("yes" if c else "no" for c in row.correct),
                 f"{row.score}/{len(row.correct)}", str(row.tokens), f"{row.seconds:.1f}", f"{row.tokens_per_s:.2f}", e_t]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict(members: Sequence[Row], ensemble: Row, question_ids: Sequence[str]) -> str:
    """One honest sentence on the table: did the ensemble answer as many as its best member, and at what time cost."""
    best = max(members, key=lambda r: (r.score, -r.seconds))
    n = len(ensemble.correct)
    cost = f"in {ensemble.seconds / best.seconds:.2f}x {best.label}'s time" if best.seconds > 0 else ""
    if ensemble.score > best.score:
        return (f"The ensemble answered {ensemble.score}/{n}, more than any member alone "
                f"(best: {best.label}, {best.score}/{n}), {cost}.")
    if ensemble.score == best.score:
        others = "".join(f"; {r.label}: {r.score}/{n}" for r in members if r is not best)
        return (f"The ensemble answered {ensemble.score}/{n}, as many as its best member "
                f"({best.label}: {best.score}/{n}{others}), {cost}.")
    lost = [f"{qid} (ensemble {_cell(e)}, {best.label} {_cell(b)})"
            for qid, e, b, ok_e, ok_b in zip(question_ids, ensemble.answers, best.answers, ensemble.correct, best.correct)
            if ok_b and not ok_e]
    return (f"The ensemble answered {ensemble.score}/{n}, fewer than {best.label} ({best.score}/{n}); it lost "
            f"{', '.join(lost)}. Where the members disagree the fused vote can side with the weaker member: "
            "docs/benchmarks.md ('Three members', 'Per-member fusion weights') measures when, and fusion_weights is the lever.")


# ---------------------------------------------------------------------------- running
def _timed(label: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` after saying what it is, then say how long it took (no silent waits)."""
    print(label, end=" ", flush=True)
    t0 = time.perf_counter()
    value = action()
    print(f"{time.perf_counter() - t0:.1f} s", flush=True)
    return value


def load_demo_members(args: argparse.Namespace, names: Sequence[str]) -> list[Any]:
    """Load the members one by one, each announced with what its wait is (conversion or cache)."""
    members = []
    for name, opts in zip(names, member_options(args, len(names))):
        print(f"{name}: ", end="", flush=True)
        note = load_note(name, conversion_pending(name))
        members.append(_timed(note, lambda name=name, opts=opts: resolve_members([name], **opts)[0]))
    return members


def run_row(ensemble: Ensemble, label: str, prompts: list[Any], problems: Sequence[Problem],
            batched: bool) -> tuple[Row, list[Any]]:
    """Every question through one run (a member alone or the ensemble), with a progress line per answer."""
    row = Row(label)
    results: list[Any] = []
    if batched:
        t0 = time.perf_counter()
        results = ensemble.batch(prompts, max_new_tokens=TABLE_TOKENS, stop=STOP)
        row.seconds = time.perf_counter() - t0
        for result, problem in zip(results, problems):
            add_result(row, result, problem.answer)
        print(f"  {label}: {len(prompts)} questions in one batch, {row.seconds:.1f} s, {row.score}/{len(prompts)} correct",
              flush=True)
        return row, results
    for i, (prompt, problem) in enumerate(zip(prompts, problems)):
        t0 = time.perf_counter()
        result = ensemble.generate(prompt, max_new_tokens=TABLE_TOKENS, stop=STOP)
        row.seconds += time.perf_counter() - t0
        add_result(row, result, problem.answer)
        results.append(result)
        print(f"  [{i + 1}/{len(prompts)}] {problem.id} {label}: answer {_cell(row.answers[-1])} (gold {problem.answer}), "
              f"{result.completion_tokens} tokens, {time.perf_counter() - t0:.1f} s", flush=True)
    return row, results


def warm_up(runs: Sequence[Ensemble]) -> None:
    """A tiny answer per run: the first passes of a fresh process set up kernels, caches and the ensemble's
    token tables (once per process, seconds; the table's times should not carry them)."""
    for ens in runs:
        ens.warm_up()
        ens.generate(WARMUP_PROMPT, max_new_tokens=4)


def run_demo(args: argparse.Namespace, stats_lines: Callable[[dict[str, Any]], list[str]]) -> int:
    """``ensemble demo``: the table, the verdict, then one streamed ensemble answer (see the module docstring).

    ``stats_lines`` formats a result's statistics: the CLI passes its ``format_stats``, so that
    every command prints them alike without this module importing the CLI (no import cycle).
    """
    t_start = time.perf_counter()
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    names = list(args.members or DEMO_MEMBERS)
    gpu = on_gpu(args.device)
    count = 1 if args.quick else (args.questions or (GPU_QUESTIONS if gpu else CPU_QUESTIONS))
    problems, shots = demo_questions(count)
    prompts = [cot_prompt(p.question, shots) for p in problems]
    drafter = drafter_index(names)

    print(f"tokensemble demo: {' and '.join(names)}, each alone and as a SAFE ensemble, on {count} fixed "
          f"arithmetic question{'s' if count > 1 else ''}"
          + ("." if args.quick else "; then the ensemble streams one answer."), flush=True)
    members = load_demo_members(args, names)
    singles = [Ensemble([m], method="single") for m in members]
    ensemble = Ensemble(members, method="safe", drafter=drafter, **DEMO_SAFE_CONFIG)
    safe_label = f"SAFE ensemble ({members[drafter].name} drafting)"
    _timed("Warming up (first passes of a fresh process: kernels, caches, token tables; once per process) ...",
           lambda: warm_up([*singles, ensemble]))

    which = f"the first {count} questions" if count > 1 else "the first question"
    print(f"\nQuestions: {which} of the arith set (arith_problems, seed {ARITH_SEED}; the benchmark's "
          f"held-out arithmetic), {SHOTS}-shot chain of thought, {TABLE_TOKENS} new tokens, greedy"
          + ("; each run as one batch" if gpu else "") + ".")
    rows: list[Row] = []
    for run, m in zip(singles, members):
        row, _ = run_row(run, f"{m.name} alone", prompts, problems, gpu)
        rows.append(row)
    ens_row, outputs = run_row(ensemble, safe_label, prompts, problems, gpu)
    print()
    for line in format_table([*rows, ens_row], [p.answer for p in problems]):
        print(line)
    print("(tokens: each row's own tokenizer, the drafter's for the ensemble; E/T: share of the tokens an ensemble "
          "decision chose)")
    print(verdict(rows, ens_row, [p.id for p in problems]))

    if args.quick:
        result = outputs[0]
        print(f"\n--- {safe_label} on {problems[0].id}: {problems[0].question}\n{result.text}")
        for line in stats_lines(result.stats):
            print("  " + line)
    else:
        question = args.question or STREAM_QUESTION
        print(f"\n--- {safe_label}, streamed (zero-shot chain of thought): {question}")
        stream = ensemble.stream(cot_prompt(question), max_new_tokens=args.max_new_tokens, stop=STOP)
        for delta in stream:
            print(delta, end="", flush=True)
        print()
        result = stream.result
        reference = STREAM_ANSWER if question == STREAM_QUESTION else None
        print(f"--- {result.seconds:.1f} s, {result.completion_tokens} tokens, finish={result.finish_reason}"
              f"{stream_check(result.text, result.finish_reason, reference, args.max_new_tokens)}")
        for line in stats_lines(result.stats):
            print("  " + line)
    print(f"\nTotal demo time {time.perf_counter() - t_start:.1f} s.")
    return 0
