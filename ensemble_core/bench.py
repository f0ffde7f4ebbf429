"""The benchmark harness behind ``ensemble bench``.

Every method runs on the same questions, *interleaved* per question in one process
(question 1: every method, question 2: every method, ...), so that machine load, caches
and thermal state affect all methods alike and the latency ratios are fair.

Rows (one per method setting):

* ``single[<member>]``: each member alone with Hugging Face ``model.generate`` (greedy,
  KV cache): the speed limit every ensemble is measured against;
* ``every-token[<distribution>]``: UniTE (and GaC on request) at every token;
* ``safe[drafter=<member>]``: SAFE with each member as drafter;
* ``specem``, ``generate-then-select``.

A method whose module cannot be imported, or whose construction fails, is reported as
*skipped* with the reason (summary.md / summary.json), never dropped silently. A method
that raises on one question gets an ``error`` record for that question.

Outputs in the results folder: ``results.jsonl`` (one record per method and question),
``summary.json``, ``summary.md`` (table, skipped methods, issue targets met / missed) and
PNG plots (``latency_per_method.png``, ``latency_vs_length.png``, ``et_distribution.png``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .alignment import REPLACEMENT_CHAR, decode
from .datasets import DEFAULT_SHOTS, Problem, cot_prompt, load_dataset, score
from .ensemble import Ensemble, method_class, resolve_members
from .errors import ConfigurationError, EnsembleError, InvalidOptionError
from .members import Member

ALL_METHODS = ("single", "every-token", "safe", "specem", "generate-then-select")
RESULTS_FILE = "results.jsonl"


# ============================================================================ options
@dataclass
class BenchOptions:
    """Everything one benchmark run depends on (recorded in summary.json)."""

    dataset: str = "gsm8k"
    data_path: str | None = None
    limit: int | None = 20
    offset: int = 0
    shots: int | None = None  # None: the dataset's default (datasets.DEFAULT_SHOTS)
    methods: tuple[str, ...] = ALL_METHODS
    members: tuple[str, ...] = ("smollm2-135m-instruct", "gemma3-270m")
    devices: tuple[str, ...] = ()
    dtype: str = "auto"
    max_new_tokens: int = 256
    #: Same for every method: a base model answering through the fallback transcript goes on
    #: to invent the next "Question:" after answering; its answer is then not the last number.
    stop: tuple[str, ...] = ("\nQuestion:",)
    every_token_distributions: tuple[str, ...] = ("unite",)
    safe_drafters: tuple[int, ...] | None = None  # None: every member in turn
    method_config: dict[str, dict[str, Any]] = field(default_factory=dict)  # method name (or "*") → overrides
    out: str = "results/bench"
    resume: bool = False
    warmup: bool = True
    plots: bool = True
    microbench: bool = True
    microbench_reps: int = 5
    progress: bool = True
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    command: str = ""

    def __post_init__(self) -> None:
        self.methods = tuple(self.methods)
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        if unknown or not self.methods:
            raise InvalidOptionError("methods", list(self.methods), "a non-empty subset of " + ", ".join(ALL_METHODS))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidOptionError("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if self.shots is not None and (not isinstance(self.shots, int) or self.shots < 0):
            raise InvalidOptionError("shots", self.shots, "an integer >= 0 or None (the dataset's default)")
        bad = [d for d in self.every_token_distributions if d not in ("unite", "gac")]
        if bad or not self.every_token_distributions:
            raise InvalidOptionError("every_token_distributions", list(self.every_token_distributions),
                                     "a non-empty subset of unite, gac")
        if len(self.members) < 1:
            raise InvalidOptionError("members", list(self.members), "at least one member")
        if self.devices and len(self.devices) not in (1, len(self.members)):
            raise InvalidOptionError("devices", list(self.devices),
                                     f"one device for all members or one per member ({len(self.members)})")
        if self.safe_drafters is not None:
            bad_d = [d for d in self.safe_drafters if not 0 <= d < len(self.members)]
            if bad_d:
                raise InvalidOptionError("safe_drafters", list(self.safe_drafters),
                                         f"member indices in 0..{len(self.members) - 1}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidOptionError("threads", self.threads, "an integer >= 1 or None")
        if not isinstance(self.microbench_reps, int) or self.microbench_reps < 1:
            raise InvalidOptionError("microbench_reps", self.microbench_reps, "an integer >= 1")


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


class _TimingStreamer:
    """A ``generate`` streamer that only records when new tokens arrive.

    ``generate`` calls ``put`` once with the prompt, then once per new token, so the
    arrival times give time to first token and time to the L-th token exactly, with no
    extra thread (unlike TextIteratorStreamer).
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.calls = 0
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.extend([time.perf_counter() - self.t0] * int(value.numel()))

    def end(self) -> None:
        pass


class _TextStop:
    """Stop ``generate`` once the decoded tail of the response contains a stop string.

    transformers' ``StopStringCriteria`` precomputes tables over the whole vocabulary:
    measured 7–14 s per construction for Gemma-3's 262k vocabulary on this CPU (and
    ``generate(stop_strings=...)`` rebuilds it every call), which would land inside the
    single-model timings. Decoding the last few tokens per step costs microseconds and
    matches how the ensemble methods detect stops (on text).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int) -> None:
        self.tokenizer, self.stops, self.prompt_len = tokenizer, tuple(stops), prompt_len
        self.window = 4 * max(len(s) for s in stops) + 8  # tokens: a character may take up to 4 byte tokens

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        done = [any(s in decode(self.tokenizer, row[start:].tolist()) for s in self.stops) for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (and whether one was found)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class HFSingleRunner:
    """One member alone through Hugging Face ``model.generate`` (greedy, with cache)."""

    kind = "single"

    def __init__(self, member: Member, stop: Sequence[str] = (), l_tokens: int = 10) -> None:
        self.member = member
        self.stops = tuple(dict.fromkeys([*stop, *member.stop_strings]))
        self.l_tokens = l_tokens
        self.name = member.name

    @torch.inference_mode()
    def run(self, prompt: list[dict[str, str]], max_new_tokens: int) -> RunOutput:
        member = self.member
        ids = member.encode_prompt(member.render(prompt))
        input_ids = torch.tensor([ids], dtype=torch.long, device=member.device)
        eos = sorted(member.eos_token_ids)
        kwargs: dict[str, Any] = {}
        if self.stops:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([_TextStop(member.tokenizer, self.stops, len(ids))])
        pad = member.tokenizer.pad_token_id if member.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        streamer = _TimingStreamer()
        out = member.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=eos or None, pad_token_id=pad, streamer=streamer, **kwargs)
        seconds = time.perf_counter() - streamer.t0
        new = [int(t) for t in out[0, len(ids):]]
        finish = "length"
        if new and new[-1] in member.eos_token_ids:
            new, finish = new[:-1], "eos"
        text, stopped = cut_at_stop(member.decode(new), self.stops)
        if stopped:
            finish = "stop"
        text = text.lstrip()
        times = streamer.times
        return RunOutput(text=text, seconds=seconds, tokens=len(new), ttft=times[0] if times else None,
                         finish_reason=finish, stats={"method": "single", "member": member.name, "tokens": len(new)},
                         time_to_l=times[self.l_tokens - 1] if len(times) >= self.l_tokens else None, token_ids=new)


class EnsembleRunner:
    """A registry method (SAFE, SpecEM, every-token, generate-then-select) through :class:`Ensemble`."""

    def __init__(self, ensemble: Ensemble, kind: str) -> None:
        self.ensemble = ensemble
        self.kind = kind

    def run(self, prompt: list[dict[str, str]], max_new_tokens: int) -> RunOutput:
        r = self.ensemble.generate(prompt, max_new_tokens=max_new_tokens)
        return RunOutput(text=r.text, seconds=r.seconds, tokens=r.completion_tokens, ttft=r.time_to_first_chunk,
                         finish_reason=r.finish_reason, stats=_jsonable(r.stats))


def _jsonable(value: Any) -> Any:
    """Stats as plain JSON values (tensors and numpy scalars become numbers / lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
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


def _config_fields(method: str) -> set[str]:
    return {f.name for f in dataclasses.fields(method_class(method).config_class)}


def _overrides(method: str, options: BenchOptions) -> dict[str, Any]:
    """Config overrides for ``method``: ``*`` entries where the field exists, then the method's own."""
    fields = _config_fields(method)
    chosen = {k: v for k, v in options.method_config.get("*", {}).items() if k in fields}
    chosen.update(options.method_config.get(method, {}))
    if options.stop:
        chosen["stop"] = tuple(options.stop)
    return chosen


def check_available(options: BenchOptions) -> None:
    """Raise early for ``--set`` names no requested method knows (a typo would otherwise be silent)."""
    for key, values in options.method_config.items():
        if key == "*":
            known: set[str] = set()
            for m in options.methods:
                if m == "single":
                    continue
                try:
                    known |= _config_fields(m)
                except ConfigurationError:
                    continue
            unknown = sorted(set(values) - known)
            if unknown and known:
                raise ConfigurationError(
                    f"--set {', '.join(unknown)}: no benchmarked method has such a config field; "
                    f"known: {', '.join(sorted(known))}.")
        elif key not in ALL_METHODS or key == "single":
            raise InvalidOptionError("--set prefix", key, "a method name among " + ", ".join(ALL_METHODS[1:]))


def build_rows(members: list[Member], options: BenchOptions) -> list[Row]:
    """The benchmark rows, each with a ready runner or a skip reason."""
    rows: list[Row] = []
    l_tokens = _segment_length(options)

    def add(label: str, kind: str, make: Callable[[], Any], **info: Any) -> None:
        try:
            rows.append(Row(label, kind, runner=make(), **info))
        except (EnsembleError, ImportError, TypeError, ValueError) as exc:
            rows.append(Row(label, kind, skipped=f"{type(exc).__name__}: {exc}", **info))

    def ensemble(method: str, ms: list[Member], **config: Any) -> Callable[[], EnsembleRunner]:
        return lambda: EnsembleRunner(Ensemble(ms, method=method, max_new_tokens=options.max_new_tokens, **config), method)

    for method in options.methods:
        if method == "single":
            for m in members:
                add(f"single[{m.name}]", "single", lambda m=m: HFSingleRunner(m, options.stop, l_tokens), member=m.name)
            continue
        try:
            base = _overrides(method, options)
        except ConfigurationError as exc:
            rows.append(Row(method, method, skipped=str(exc)))
            continue
        if method == "every-token":
            for dist in options.every_token_distributions:
                cfg = {**base, "distribution": dist}
                add(f"every-token[{dist}]", method, ensemble(method, members, **cfg), config=cfg)
        elif method == "safe":
            for i in options.safe_drafters if options.safe_drafters is not None else range(len(members)):
                cfg = {**base, "drafter": i}
                add(f"safe[drafter={members[i].name}]", method, ensemble(method, members, **cfg),
                    drafter=members[i].name, config=cfg)
        else:
            add(method, method, ensemble(method, members, **base), config=base)
    return rows


def _segment_length(options: BenchOptions) -> int:
    """SpecEM's segment length L (for the "time to produce L tokens" reference)."""
    for source in (options.method_config.get("specem", {}), options.method_config.get("*", {})):
        if "segment_length" in source:
            return int(source["segment_length"])
    try:
        cls = method_class("specem").config_class
        return int(getattr(cls(), "segment_length", 10))
    except (ConfigurationError, TypeError, ValueError):
        return 10


# ============================================================================ records
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
    """E/T (ensembled tokens / total tokens) from a method's stats, when it reports one."""
    for key in ("e_t", "ensemble_ratio", "et"):
        value = stats.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    numbers = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    e = next((numbers[k] for k in ("ensembled_tokens", "ensembled") if k in numbers), None)
    t = next((numbers[k] for k in ("tokens", "total_tokens") if k in numbers), None)
    if e is not None and t:
        return float(e) / float(t)
    return None


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


# ============================================================================ summary
def _mean(values: Sequence[float]) -> float | None:
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
        chars = sum(r.get("chars", len(r.get("output", ""))) for r in ok)
        ets = [r["et"] for r in ok if r.get("et") is not None]
        ens = [r["stats"].get("ensembled_tokens") for r in ok]
        tot = [r["stats"].get("tokens") for r in ok]
        if ets and all(isinstance(x, (int, float)) for x in ens + tot) and sum(tot) > 0:
            et_total = sum(ens) / sum(tot)  # token-weighted, as the papers report it
        else:
            et_total = _mean(ets)
        finish: dict[str, int] = {}
        for r in ok:
            finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
        out[row.label] = {
            "kind": row.kind, "member": row.member, "drafter": row.drafter, "config": _jsonable(row.config),
            "questions": len(recs), "errors": len(recs) - len(ok),
            "accuracy": sum(r["correct"] for r in ok) / len(ok) if ok else None,
            "correct": sum(r["correct"] for r in ok),
            "mean_latency_s": _mean(lat), "median_latency_s": statistics.median(lat) if lat else None,
            "total_seconds": sum(lat), "tokens": toks, "mean_tokens": toks / len(ok) if ok else None,
            "tokens_per_s": toks / sum(lat) if lat and sum(lat) > 0 else None,
            "chars": chars, "s_per_100_chars": 100 * sum(lat) / chars if chars else None,
            "mean_ttft_s": _mean([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
            "mean_time_to_L_s": _mean([r["time_to_L_s"] for r in ok if r.get("time_to_L_s") is not None]),
            "et": et_total, "corrupted": sum(r["corrupted"] for r in ok), "finish_reasons": finish,
        }
    fast, slow = _fast_slow(out)
    by_member = {v["member"]: v for v in out.values() if v["kind"] == "single"}
    for v in out.values():
        own = by_member.get(v["drafter"]) if v["drafter"] else None
        for suffix, ref in (("fast", fast), ("slow", slow), ("drafter", own)):
            v[f"ratio_to_{suffix}"] = _ratio(v["s_per_100_chars"], ref["s_per_100_chars"] if ref else None)
            v[f"latency_ratio_to_{suffix}"] = _ratio(v["mean_latency_s"], ref["mean_latency_s"] if ref else None)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fast_slow(summary: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The single rows with the lowest / highest time per output character.

    Characters, not tokens: the members' tokenizers differ, and the members' answers
    differ in length (a base model may answer in one line where an instruct model writes
    a page), so time per character is the comparable cost of producing text.
    """
    singles = [v for v in summary.values() if v["kind"] == "single" and v["s_per_100_chars"]]
    if not singles:
        return None, None
    return min(singles, key=lambda v: v["s_per_100_chars"]), max(singles, key=lambda v: v["s_per_100_chars"])


def _target(tid: str, text: str, value: float | None, threshold: float, op: str, why_missing: str | None,
            detail: str = "") -> dict[str, Any]:
    if value is None:
        return {"id": tid, "target": text, "value": None, "threshold": threshold, "status": "not evaluated",
                "detail": why_missing or "no data"}
    met = value <= threshold if op == "<=" else value >= threshold
    return {"id": tid, "target": text, "value": round(value, 4), "threshold": threshold,
            "status": "met" if met else "missed", "detail": detail}


def evaluate_targets(summary: dict[str, dict[str, Any]], skipped: dict[str, str],
                     micro: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The SAFE and SpecEM issue targets, each met / missed / not evaluated (with why)."""
    fast, slow = _fast_slow(summary)
    safe_rows = {v["drafter"]: (k, v) for k, v in summary.items() if v["kind"] == "safe"}
    every = next(((k, v) for k, v in summary.items() if k == "every-token[unite]"), None) or next(
        ((k, v) for k, v in summary.items() if v["kind"] == "every-token"), None)
    specem = summary.get("specem")
    reason_safe = skipped.get(next((k for k in skipped if k.startswith("safe")), ""), "SAFE rows not run")
    targets = []

    no_singles = ("needs single rows of two members with output text (time per character is undefined for "
                  "empty answers)")
    why_safe = reason_safe if not safe_rows else no_singles if not (fast and slow and fast is not slow) else "no data"
    safe_fast = safe_rows.get(fast["member"]) if fast else None
    safe_slow = safe_rows.get(slow["member"]) if slow else None
    if fast and slow and fast is slow:
        safe_slow = None
    value = safe_fast[1]["ratio_to_slow"] if safe_fast and slow else None
    targets.append(_target(
        "safe_fast_drafter_vs_slow_member", "SAFE with the fast member drafting: time <= 0.6x the slow member alone",
        value, 0.6, "<=", why_safe,
        f"{safe_fast[0]} vs single[{slow['member']}], time per output character; per question: "
        f"{_fmt(safe_fast[1]['latency_ratio_to_slow'], 'x')}" if safe_fast and slow else ""))
    value = _ratio(every[1]["s_per_100_chars"], safe_fast[1]["s_per_100_chars"]) if every and safe_fast else None
    targets.append(_target(
        "safe_vs_every_token", "SAFE (fast drafter) >= 2.5x faster than every-token ensembling (UniTE)",
        value, 2.5, ">=", why_safe if not safe_fast else "needs an every-token row with output text",
        f"{every[0]} / {safe_fast[0]}, time per output character; per question: "
        f"{_fmt(_ratio(every[1]['mean_latency_s'], safe_fast[1]['mean_latency_s']), 'x')}" if every and safe_fast else ""))
    value = safe_slow[1]["ratio_to_drafter"] if safe_slow else None
    targets.append(_target(
        "safe_slow_drafter_vs_itself", "SAFE with the slow member drafting: time <= 1.15x that member alone",
        value, 1.15, "<=", why_safe,
        f"{safe_slow[0]} vs single[{slow['member']}], time per output character; per question: "
        f"{_fmt(safe_slow[1]['latency_ratio_to_drafter'], 'x')}" if safe_slow and slow else ""))
    ets = [(k, v["et"]) for k, v in summary.items() if v["kind"] == "safe" and v["et"] is not None]
    targets.append(_target(
        "safe_et", "E/T (ensembled / total tokens) <= 15 % (worst SAFE row)",
        max(e for _, e in ets) if ets else None, 0.15, "<=",
        reason_safe if not safe_rows else "SAFE stats report no E/T",
        ", ".join(f"{k}: {e:.1%}" for k, e in ets)))
    l_refs = [v["mean_time_to_L_s"] for v in summary.values() if v["kind"] == "single" and v["mean_time_to_L_s"]]
    value = specem["mean_ttft_s"] / max(l_refs) if specem and specem["mean_ttft_s"] and l_refs else None
    targets.append(_target(
        "specem_ttfs", "SpecEM time to first segment <= 1.5x one member's time to produce L tokens",
        value, 1.5, "<=", skipped.get("specem", "needs specem and single rows"),
        "reference: the slowest member's mean time to its L-th token (members draft one after another on one CPU)"
        + (f"; vs the fastest member: {specem['mean_ttft_s'] / min(l_refs):.2f}x"
           if specem and specem["mean_ttft_s"] and l_refs else "")))
    value = micro.get("speedup_4") if micro else None
    targets.append(_target(
        "verify_in_line_speedup", "SpecEM verify-in-line >= 2x faster than separate scoring at 4 candidates",
        value, 2.0, ">=", (micro or {}).get("skipped", "microbenchmark not run"),
        (micro or {}).get("detail", "")))
    return targets


# ============================================================================ microbenchmark
def _synchronize(member: Member) -> None:
    """Wait for the member's accelerator (a no-op on the CPU)."""
    if member.device.type == "cuda":
        torch.cuda.synchronize(member.device)


def verify_microbench(members: list[Member], reps: int = 5, candidates: Sequence[int] = (2, 4)) -> dict[str, Any]:
    """Time SpecEM's verify-in-line pass against scoring each candidate separately.

    Calls :func:`ensemble_core.verify_inline.score_candidates_inline` and
    ``score_candidates_separately`` (the same scores, one pass per candidate) on every
    member, behind the same cached context (a GSM8K question), with candidate segments of
    about ten tokens; times are per call, summed over members. Reported as skipped when
    the module is missing.
    """
    try:
        from .verify_inline import score_candidates_inline, score_candidates_separately
    except ImportError as exc:
        return {"skipped": f"ensemble_core.verify_inline is not importable: {exc}"}
    prompt = cot_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                        "How many clips did Natalia sell altogether in April and May?")
    texts = [" First, she sold 48 clips in April and then", " In May she sold half as many, which is 24 clips",
             " Let's add the two months together to get", " The total number of clips is 48 + 24 = 72."]
    result: dict[str, Any] = {"reps": reps, "members": [m.name for m in members]}
    for k in candidates:
        chosen = (texts * ((k + len(texts) - 1) // len(texts)))[:k]
        times = {"inline": 0.0, "separate": 0.0}
        for member in members:
            state = member.start(prompt)
            state.score()  # prefill the context once; both scorers reuse its cache
            cands = [member.tokenizer(t, add_special_tokens=False)["input_ids"] for t in chosen]
            for name, fn in (("inline", score_candidates_inline), ("separate", score_candidates_separately)):
                fn(state, cands)  # warm-up
                _synchronize(member)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(state, cands)
                _synchronize(member)  # GPU kernels run asynchronously: wait before reading the clock
                times[name] += (time.perf_counter() - t0) / reps
        result[f"inline_s_{k}"] = times["inline"]
        result[f"separate_s_{k}"] = times["separate"]
        result[f"speedup_{k}"] = times["separate"] / times["inline"] if times["inline"] > 0 else None
    result["detail"] = ", ".join(f"{k} candidates: inline {result[f'inline_s_{k}'] * 1000:.0f} ms vs separate "
                                 f"{result[f'separate_s_{k}'] * 1000:.0f} ms ({result[f'speedup_{k}']:.2f}x)"
                                 for k in candidates)
    return result


# ============================================================================ artefacts
def _fmt(value: Any, kind: str = "f") -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "x":
        return f"{value:.2f}x"
    return f"{value:.2f}"


def hardware() -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "processor": platform.processor()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def write_markdown(path: Path, summary: dict[str, Any]) -> None:
    meta = summary["meta"]
    lines = [f"# Benchmark: {meta['dataset']} ({meta['questions']} questions)", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- members: {', '.join(meta['members'])}; max_new_tokens {meta['max_new_tokens']}; shots {meta['shots']}",
             f"- hardware: {meta['hardware']['platform']}, {meta['hardware']['cpu_count']} CPUs "
             f"({meta['hardware']['torch_threads']} torch threads), torch {meta['hardware']['torch']}"
             + (f", GPUs: {', '.join(meta['hardware']['gpus'])}" if meta['hardware'].get('gpus') else ""), "",
             "| method | n | accuracy | mean latency s | tokens/s | s/100 chars | TTFT/TTFS s | E/T | x own drafter "
             "| x fast member | x slow member | corrupted | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, v in summary["methods"].items():
        lines.append(f"| {label} | {v['questions']} | {_fmt(v['accuracy'], 'pct')} | {_fmt(v['mean_latency_s'])} | "
                     f"{_fmt(v['tokens_per_s'], 'f')} | {_fmt(v['s_per_100_chars'])} | {_fmt(v['mean_ttft_s'])} | "
                     f"{_fmt(v['et'], 'pct')} | "
                     f"{_fmt(v['ratio_to_drafter'], 'x')} | {_fmt(v['ratio_to_fast'], 'x')} | "
                     f"{_fmt(v['ratio_to_slow'], 'x')} | {v['corrupted']} | {v['errors']} |")
    lines += ["", "Tokens are counted with each row's primary member's tokenizer (the drafter for SAFE, the "
              "first member otherwise). The x columns compare time per output character (s/100 chars) on the same "
              "questions, because the methods' answers differ in length; the per-question latency ratios are in "
              "summary.json (latency_ratio_to_*). Fast / slow member: the single row with the lowest / highest "
              "time per character.", ""]
    if summary["skipped"]:
        lines += ["## Skipped methods", ""] + [f"- **{k}**: {v}" for k, v in summary["skipped"].items()] + [""]
    lines += ["## Targets (SAFE and SpecEM issues)", "", "| target | value | threshold | status | detail |",
              "|---|---|---|---|---|"]
    for t in summary["targets"]:
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {t['threshold']} | **{t['status']}** | {t['detail']} |")
    micro = summary.get("microbench")
    if micro and "skipped" not in micro:
        lines += ["", f"Verify-in-line microbenchmark ({micro['reps']} repetitions, summed over members): {micro['detail']}."]
    lines += ["", "Plots: `latency_per_method.png`, `latency_vs_length.png`, `et_distribution.png`; "
              f"per-question records: `{RESULTS_FILE}`.", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def write_plots(out: Path, labels: list[str], records: list[dict[str, Any]]) -> list[str]:
    """Latency per method (bar), latency vs output length (scatter), E/T distribution (histogram)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    written = []
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    means = [_mean([r["latency_s"] for r in ok if r["method"] == lb]) or 0.0 for lb in labels]
    sds = [statistics.pstdev([r["latency_s"] for r in ok if r["method"] == lb] or [0.0]) for lb in labels]
    ax.barh(labels, means, xerr=sds, color="tab:blue", alpha=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("mean latency per question (s), ± 1 sd")
    ax.set_title("Latency per method")
    fig.tight_layout()
    fig.savefig(out / "latency_per_method.png", dpi=110)
    plt.close(fig)
    written.append("latency_per_method.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    for lb in labels:
        pts = [(r["tokens"], r["latency_s"]) for r in ok if r["method"] == lb]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=lb, s=18, alpha=0.75)
    ax.set_xlabel("output tokens (primary member's tokenizer)")
    ax.set_ylabel("latency (s)")
    ax.set_title("Latency vs output length")
    if any(r["method"] in labels for r in ok):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_length.png", dpi=110)
    plt.close(fig)
    written.append("latency_vs_length.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    et_labels = [lb for lb in labels if any(r["method"] == lb and r.get("et") is not None for r in ok)]
    if et_labels:
        ax.hist([[r["et"] for r in ok if r["method"] == lb and r.get("et") is not None] for lb in et_labels],
                bins=[i / 20 for i in range(21)], label=et_labels, alpha=0.8)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no method reported E/T", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("E/T per question (ensembled tokens / total tokens)")
    ax.set_ylabel("questions")
    ax.set_title("E/T distribution")
    fig.tight_layout()
    fig.savefig(out / "et_distribution.png", dpi=110)
    plt.close(fig)
    written.append("et_distribution.png")
    return written


# ============================================================================ driver
def _load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _warm_up(rows: list[Row]) -> None:
    """One tiny generation per row, so one-time costs (kernels, allocator) stay out of the timings."""
    for row in rows:
        if row.runner is None:
            continue
        try:
            row.runner.run([{"role": "user", "content": "What is 2 + 3?"}], 4)
        except Exception as exc:  # noqa: BLE001 - a broken method is reported per question below
            print(f"warm-up of {row.label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def run_bench(options: BenchOptions, members: list[Member] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``options`` and write every artefact; returns the summary."""
    from tqdm.auto import tqdm

    check_available(options)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = load_dataset(options.dataset, options.limit, options.offset, options.data_path)
    n_shots = options.shots if options.shots is not None else DEFAULT_SHOTS.get(options.dataset, 0)
    shots: list[Problem] = []
    if n_shots:
        pool = load_dataset(options.dataset, path=options.data_path)
        chosen_ids = {p.id for p in problems}
        shots = [p for p in reversed(pool) if p.id not in chosen_ids][:n_shots]  # from the far end, never overlapping
    if members is None:
        member_options: list[dict[str, Any]] = []
        for i in range(len(options.members)):
            opts: dict[str, Any] = {"dtype": options.dtype}
            if options.devices:
                opts["device"] = options.devices[i if len(options.devices) > 1 else 0]
            member_options.append(opts)
        members = [resolve_members([name], **opts)[0] for name, opts in zip(options.members, member_options)]
    rows = build_rows(members, options)
    active = [r for r in rows if r.runner is not None]
    skipped = {r.label: r.skipped for r in rows if r.skipped}
    for label, why in skipped.items():
        print(f"skipping {label}: {why}", file=sys.stderr)

    results_path = out / RESULTS_FILE
    previous = _load_records(results_path) if options.resume else []
    done = {(r["method"], r["question_id"]) for r in previous if "error" not in r}
    if options.warmup:
        _warm_up(active)
    mode = "a" if options.resume else "w"
    bar = tqdm(total=len(problems) * len(active), disable=not options.progress, desc="bench", unit="run")
    with results_path.open(mode, encoding="utf-8") as fh:
        for problem in problems:
            prompt = cot_prompt(problem.question, shots)
            for row in active:
                bar.set_postfix_str(f"{problem.id} {row.label}", refresh=False)
                if (row.label, problem.id) in done:
                    bar.update(1)
                    continue
                try:
                    record = make_record(row, problem, row.runner.run(prompt, options.max_new_tokens))
                except Exception as exc:  # noqa: BLE001 - recorded, counted and shown in the summary
                    record = error_record(row, problem, exc)
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                fh.flush()
                bar.update(1)
    bar.close()

    qids = {p.id for p in problems}
    labels = [r.label for r in active]
    records = [r for r in _load_records(results_path) if r["question_id"] in qids and r["method"] in labels]
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:  # with --resume a retried question replaces its earlier error record
        latest[(r["method"], r["question_id"])] = r
    records = list(latest.values())
    methods = summarize_rows(rows, records)
    micro = None
    if options.microbench and ("specem" in options.methods):
        micro = verify_microbench(members, reps=options.microbench_reps)
    summary = {
        "meta": {"dataset": options.dataset, "questions": len(problems), "offset": options.offset,
                 "members": [m.name for m in members], "max_new_tokens": options.max_new_tokens, "shots": n_shots,
                 "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "command": options.command or "run_bench(...)", "hardware": hardware(),
                 "options": _jsonable(dataclasses.asdict(options))},
        "methods": methods, "skipped": skipped, "microbench": micro,
        "targets": evaluate_targets(methods, skipped, micro),
    }
    if options.plots:
        summary["plots"] = write_plots(out, labels, records)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    write_markdown(out / "summary.md", summary)
    return summary
