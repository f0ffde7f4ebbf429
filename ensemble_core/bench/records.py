"""Per-question records and per-method summaries (accuracy, latency, tokens/s, TTFT, E/T, ratios).

Records read the methods' typed statistics by their fixed keys
(:mod:`ensemble_core.decoding.stats`): ``e_t``, ``ensembled`` and ``tokens``; nothing is guessed.
"""

from __future__ import annotations

import random
import statistics
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.bench.datasets import Problem, score
from ensemble_core.text.alignment import REPLACEMENT_CHAR

RESULTS_FILE = "results.jsonl"


def jsonable(value: Any) -> Any:
    """Stats as plain JSON values (tensors and numpy scalars become numbers / lists)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def is_corrupted(text: str) -> bool:
    """Text with U+FFFD (a broken byte sequence) or lone surrogates (not encodable as UTF-8)."""
    if REPLACEMENT_CHAR in text:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def ensemble_ratio(stats: dict[str, Any]) -> float | None:
    """E/T of a token-level method (its ``e_t``); None for methods that do not ensemble tokens."""
    value = stats.get("e_t")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def make_record(row: Row, problem: Problem, out: RunOutput) -> dict[str, Any]:
    predicted, correct = score(out.text, problem.answer)
    return {
        "method": row.label, "kind": row.kind, "question_id": problem.id, "gold": problem.answer,
        "output": out.text, "extracted": predicted, "correct": correct,
        "latency_s": round(out.seconds, 4), "tokens": out.tokens, "chars": len(out.text),
        "tokens_per_s": round(out.tokens / out.seconds, 3) if out.seconds > 0 else None,
        "ttft_s": None if out.ttft is None else round(out.ttft, 4),
        "time_to_L_s": None if out.time_to_l is None else round(out.time_to_l, 4),
        "finish_reason": out.finish_reason, "et": ensemble_ratio(out.stats),
        "corrupted": is_corrupted(out.text), "stats": out.stats,
    }


def error_record(row: Row, problem: Problem, exc: BaseException) -> dict[str, Any]:
    return {"method": row.label, "kind": row.kind, "question_id": problem.id, "gold": problem.answer,
            "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}


def output_chars(record: dict[str, Any]) -> int:
    """A record's output length in characters (records written before ``chars`` was kept: its output's)."""
    return record.get("chars", len(record.get("output", "")))


def mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_rows(rows: list[Row], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-method aggregates (accuracy, latency, tokens/s, TTFT, E/T, corrupted, ratios)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.skipped:
            continue
        recs = [r for r in records if r["method"] == row.label]
        ok = [r for r in recs if "error" not in r]
        lat = [r["latency_s"] for r in ok]
        toks = sum(r["tokens"] for r in ok)
        chars = sum(output_chars(r) for r in ok)
        ets = [r["et"] for r in ok if r.get("et") is not None]
        ens = [r["stats"].get("ensembled") for r in ok]
        tot = [r["stats"].get("tokens") for r in ok]
        if ets and all(isinstance(x, (int, float)) for x in ens + tot) and sum(tot) > 0:
            et_total = sum(ens) / sum(tot)  # token-weighted, as the papers report it
        else:
            et_total = mean(ets)
        finish: dict[str, int] = {}
        for r in ok:
            finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
        out[row.label] = {
            "kind": row.kind, "member": row.member, "drafter": row.drafter, "members": list(row.members),
            "config": jsonable(row.config),
            "questions": len(recs), "errors": len(recs) - len(ok),
            "accuracy": sum(r["correct"] for r in ok) / len(ok) if ok else None,
            "correct": sum(r["correct"] for r in ok),
            "mean_latency_s": mean(lat), "median_latency_s": statistics.median(lat) if lat else None,
            "total_seconds": sum(lat), "tokens": toks, "mean_tokens": toks / len(ok) if ok else None,
            "tokens_per_s": toks / sum(lat) if lat and sum(lat) > 0 else None,
            "chars": chars, "s_per_100_chars": 100 * sum(lat) / chars if chars else None,
            "mean_ttft_s": mean([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
            "mean_time_to_L_s": mean([r["time_to_L_s"] for r in ok if r.get("time_to_L_s") is not None]),
            "et": et_total, "corrupted": sum(r["corrupted"] for r in ok), "finish_reasons": finish,
        }
    fast, slow = fast_slow(out)
    for label, check in vs_best_member(out, records).items():
        out[label]["vs_best_member"] = check
    by_member = {v["member"]: v for v in out.values() if v["kind"] == "single"}
    for v in out.values():
        own = by_member.get(v["drafter"]) if v["drafter"] else None
        for suffix, ref in (("fast", fast), ("slow", slow), ("drafter", own)):
            v[f"ratio_to_{suffix}"] = _ratio(v["s_per_100_chars"], ref["s_per_100_chars"] if ref else None)
            v[f"latency_ratio_to_{suffix}"] = _ratio(v["mean_latency_s"], ref["mean_latency_s"] if ref else None)
    return out


# ============================================================================ a weak member
#: Resamples and seed of the accuracy difference's paired bootstrap (as ``intervals.ratio_interval``).
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0


def accuracy_difference(pairs: Sequence[tuple[bool, bool]], level: float = 0.95,
                        resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float] | None:
    """``(difference, low, high)``: accuracy of A minus accuracy of B over paired questions (``(a_correct,
    b_correct)`` per question) and its percentile-bootstrap interval (questions drawn with replacement,
    both rows on the same draw: a hard question is hard for both). None for fewer than two questions."""
    n = len(pairs)
    if n < 2:
        return None
    deltas = [int(a) - int(b) for a, b in pairs]
    rng = random.Random(seed)
    draws = sorted(sum(deltas[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    return sum(deltas) / n, draws[int(tail * (resamples - 1))], draws[int(round((1.0 - tail) * (resamples - 1)))]


def _correct_by_question(records: Sequence[dict[str, Any]], label: str) -> dict[str, bool]:
    return {r["question_id"]: bool(r["correct"]) for r in records if r["method"] == label and "error" not in r}


def _settings(row: dict[str, Any]) -> dict[str, Any]:
    """A row's method options apart from which member drafts (an index, which differs between a set and its subsets)."""
    return {k: v for k, v in (row.get("config") or {}).items() if k != "drafter"}


def vs_best_member(summary: dict[str, dict[str, Any]], records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every ensemble row against its best member alone: is adding members making the answers worse?

    For each ensemble row whose members have ``single`` rows in the run: the most accurate of
    them (``member``), the difference ensemble minus that member over the questions both
    answered, its paired-bootstrap 95 % interval (:func:`accuracy_difference`) and a
    ``status``: ``"below"`` (the whole interval under 0: the ensemble is clearly worse than
    its best member), ``"above"`` (the whole interval over 0) or ``"tie"``. ``lowered_by``
    names the members whose removal made the same method (same drafter, same options) more
    accurate in this run (a ``--subsets`` row); ``weaker`` lists the members less accurate alone than
    the best one, the suspects when the run has no subset rows.
    """
    singles = {v["member"]: (k, v) for k, v in summary.items() if v["kind"] == "single" and v.get("accuracy") is not None}
    out: dict[str, dict[str, Any]] = {}
    for label, row in summary.items():
        members = row.get("members") or []
        known = [m for m in members if m in singles]
        if row["kind"] == "single" or row.get("accuracy") is None or not known:
            continue
        best = max(known, key=lambda m: singles[m][1]["accuracy"])
        best_label, best_row = singles[best]
        mine, theirs = _correct_by_question(records, label), _correct_by_question(records, best_label)
        pairs = [(mine[q], theirs[q]) for q in mine if q in theirs]
        diff = accuracy_difference(pairs)
        status = None
        if diff is not None:
            status = "below" if diff[2] < 0 else "above" if diff[1] > 0 else "tie"
        subsets = [v for k, v in summary.items() if k != label and v["kind"] == row["kind"]
                   and v.get("drafter") == row.get("drafter") and _settings(v) == _settings(row)
                   and v.get("accuracy") is not None
                   and set(v.get("members") or ()) < set(members) and v["accuracy"] > row["accuracy"]]
        lowered = sorted({m for v in subsets for m in members if m not in v["members"]}, key=members.index)
        out[label] = {
            "member": best, "member_accuracy": best_row["accuracy"], "accuracy": row["accuracy"],
            "difference": None if diff is None else round(diff[0], 4),
            "interval": None if diff is None else [round(diff[1], 4), round(diff[2], 4)],
            "questions": len(pairs), "status": status, "lowered_by": lowered,
            "weaker": [m for m in known if singles[m][1]["accuracy"] < best_row["accuracy"]],
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fast_slow(summary: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The single rows with the lowest / highest time per output character.

    Characters, not tokens: the members' tokenizers differ, and the members' answers
    differ in length (a base model may answer in one line where an instruct model writes
    a page), so time per character is the comparable cost of producing text.
    """
    singles = [v for v in summary.values() if v["kind"] == "single" and v["s_per_100_chars"]]
    if not singles:
        return None, None
    return min(singles, key=lambda v: v["s_per_100_chars"]), max(singles, key=lambda v: v["s_per_100_chars"])


# ============================================================================ runners
@dataclass
class RunOutput:
    """What one method produced for one question, with its timings."""

    text: str
    seconds: float
    tokens: int
    ttft: float | None
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    time_to_l: float | None = None
    token_ids: list[int] | None = None  # single rows: the generated ids (not written to the records)


# ============================================================================ plan
@dataclass
class Row:
    """One method setting of the benchmark: a label, how to build it, its role."""

    label: str
    kind: str  # single | every-token | safe | specem | generate-then-select
    runner: Any = None
    skipped: str | None = None
    member: str | None = None  # single rows
    drafter: str | None = None  # safe rows
    config: dict[str, Any] = field(default_factory=dict)
    members: tuple[str, ...] = ()  # ensemble rows: the members ensembled

