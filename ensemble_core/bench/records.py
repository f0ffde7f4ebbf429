"""Per-question records and per-method summaries (accuracy, latency, tokens/s, TTFT, E/T, ratios).

Records read the methods' typed statistics by their fixed keys
(:mod:`ensemble_core.decoding.stats`): ``e_t``, ``ensembled`` and ``tokens``; nothing is guessed.
"""

from __future__ import annotations

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
    by_member = {v["member"]: v for v in out.values() if v["kind"] == "single"}
    for v in out.values():
        own = by_member.get(v["drafter"]) if v["drafter"] else None
        for suffix, ref in (("fast", fast), ("slow", slow), ("drafter", own)):
            v[f"ratio_to_{suffix}"] = _ratio(v["s_per_100_chars"], ref["s_per_100_chars"] if ref else None)
            v[f"latency_ratio_to_{suffix}"] = _ratio(v["mean_latency_s"], ref["mean_latency_s"] if ref else None)
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

