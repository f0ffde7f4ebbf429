"""The issues' targets as data (``targets.json``), evaluated against a benchmark summary.

A target names a value, a comparison and a threshold; the value is computed from the
summary's rows by a tiny declarative spec (see ``targets.json``: a ratio of two rows'
metrics, the largest metric over rows, or a microbenchmark figure). New targets (a third
member, batching, ...) are new entries in the file, not new code. A target that cannot be
evaluated says why (a skipped method's reason, or which row is missing). A target set on
particular datasets (``"datasets": ["arith"]``) is only judged on those; elsewhere its value
is reported with the status ``"reported"`` (the arith accuracy target says nothing about GSM8K).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ensemble_core.bench.intervals import Record, describe, paired, ratio_interval
from ensemble_core.bench.records import fast_slow

TARGETS_FILE = Path(__file__).with_name("targets.json")

Summary = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Target:
    """One target: ``value op threshold`` (``op`` is ``"<="`` or ``">="``)."""

    id: str
    text: str
    value: dict[str, Any]
    op: str
    threshold: float
    issue: str = ""
    datasets: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", tuple(self.datasets))
        if self.op not in ("<=", ">="):
            raise ValueError(f"target {self.id}: op must be '<=' or '>=', got {self.op!r}")
        if not ({"ratio", "diff", "max", "micro", "throughput"} & set(self.value)):
            raise ValueError(f"target {self.id}: value needs 'ratio', 'diff', 'max', 'micro' or 'throughput'")


def load_targets(path: Path | str = TARGETS_FILE) -> list[Target]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    known = {"id", "text", "value", "op", "threshold", "issue", "datasets"}
    return [Target(**{k: v for k, v in t.items() if k in known}, extra={k: v for k, v in t.items() if k not in known})
            for t in data["targets"]]


def select(summary: Summary, selector: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows a selector names (see the module docstring), as ``(label, row)`` pairs."""
    kind, _, which = selector.partition(":")
    if not which:
        return [(selector, summary[selector])] if selector in summary else []
    if kind == "ensemble":  # every row that is not a single member
        return [(k, v) for k, v in summary.items() if v["kind"] != "single"]
    rows = [(k, v) for k, v in summary.items() if v["kind"] == kind]
    if which == "*":
        return rows
    fast, slow = fast_slow(summary)
    if which in ("fast", "slow"):
        ref = fast if which == "fast" else slow
        if ref is None or (fast is slow and which == "slow"):
            return []
        which = ref["member"]
    if kind == "single":
        return [(k, v) for k, v in rows if v["member"] == which]
    if kind == "safe":
        return [(k, v) for k, v in rows if v["drafter"] == which]
    exact = [(k, v) for k, v in rows if k == f"{kind}[{which}]"]
    return exact or rows[:1]


def _missing(selectors: list[str], summary: Summary, skipped: dict[str, str]) -> str:
    """Why a target has no value: a skipped method's reason, or the row it needs."""
    for sel in selectors:
        kind = sel.partition(":")[0]
        reason = next((why for label, why in skipped.items() if label == kind or label.startswith(kind)), None)
        if reason and not select(summary, sel):
            return reason
    if any(sel.startswith("single:") and sel.split(":")[1] in ("fast", "slow") for sel in selectors):
        return ("needs single rows of two members with output text (time per character is undefined for "
                "empty answers)")
    return "needs rows: " + ", ".join(s for s in selectors if not select(summary, s))


def _fmt_x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


#: A computed target value: ``(value, detail, interval)``; the interval is the ratio's bootstrap
#: interval over the questions (``intervals.ratio_interval``) when the records allow one.
Computed = tuple[float | None, str, tuple[float, float] | None]


def _interval(records: Sequence[Record] | None, num: str, den: str, metric: str,
              metric_b: str | None = None) -> tuple[tuple[float, float] | None, str]:
    """The ratio ``num / den``'s interval and its description (nothing without records)."""
    if not records:
        return None, ""
    pairs = paired(records, num, den)
    interval = ratio_interval(pairs, metric, metric_b)
    return interval, describe(interval, len(pairs))


def _ratio_each(target: Target, summary: Summary, skipped: dict[str, str],
                records: Sequence[Record] | None) -> Computed:
    """A ratio target evaluated for every A row (``"each": true``): the best value, every row's in the detail.

    Why: a target such as "SAFE with SmolLM2 drafting <= 1.0x Qwen alone, for the trio or
    the Qwen pair" holds for a member set, and a run with ``--subsets`` has one SAFE row
    per set; taking the first row would judge the trio only. With ``"same_members": true``
    the B row is the one with the same members (SAFE vs every-token *on the same members*);
    ``"invert": true`` makes the value B / A (how many times faster A is than B).
    """
    spec = target.value
    sel_a, sel_b = spec["ratio"]
    metric = spec["metric"]
    b_rows = [(k, v) for k, v in select(summary, sel_b) if v.get(metric)]
    pairs = []
    for a_label, a in select(summary, sel_a):
        if a.get(metric) is None:
            continue
        same = [(k, v) for k, v in b_rows if v.get("members") == a.get("members")]
        match = same[:1] if spec.get("same_members") else b_rows[:1]
        if match:
            num, den = ((a_label, a), match[0])[::-1 if spec.get("invert") else 1]
            pairs.append((num[0], den[0], num[1][metric] / den[1][metric]))
    if not pairs:
        return None, _missing([sel_a, sel_b], summary, skipped), None
    pick = min if target.op == "<=" else max
    best = pick(pairs, key=lambda p: p[2])
    interval, said = _interval(records, best[0], best[1], metric)
    detail = (f"best: {best[0]} / {best[1]} ({metric}" + (f"; {said}" if said else "") + "); "
              + "; ".join(f"{a} / {b}: {_fmt_x(v)}" for a, b, v in pairs))
    return best[2], detail, interval


def compute(target: Target, summary: Summary, skipped: dict[str, str], micro: dict[str, Any] | None,
            records: Sequence[Record] | None = None) -> Computed:
    """``(value, detail, interval)`` of one target; the detail says why when the value is None.

    With the run's per-question ``records`` a ratio also gets its bootstrap interval over the
    questions (:mod:`.intervals`); the value itself is always the summary's.
    """
    spec = target.value
    if "throughput" in spec:  # evaluated by the throughput benchmark (bench.throughput), not per question
        return None, "measured by `ensemble bench --throughput`", None
    if "micro" in spec:
        if not micro or "skipped" in micro:
            return None, (micro or {}).get("skipped", "microbenchmark not run"), None
        return micro.get(spec["micro"]), micro.get("detail", ""), None
    metric = spec["metric"]
    if "max" in spec:
        rows = [(k, v[metric]) for k, v in select(summary, spec["max"]) if v.get(metric) is not None]
        if not rows:
            return None, _missing([spec["max"]], summary, skipped), None
        return (max(v for _, v in rows),
                ", ".join(f"{k}: {v:.1%}" if metric == "et" else f"{k}: {v:.3g}" for k, v in rows), None)
    if "diff" in spec:  # best of A minus best of B (accuracies: a ratio is undefined when B scores 0)
        sel_a, sel_b = spec["diff"]
        best = [max(((k, v[metric]) for k, v in select(summary, sel) if v.get(metric) is not None),
                    key=lambda kv: kv[1], default=None) for sel in (sel_a, sel_b)]
        if best[0] is None or best[1] is None:
            return None, _missing([sel_a, sel_b], summary, skipped), None
        (a_label, a), (b_label, b) = best
        return (a - b, f"best {sel_a.partition(':')[0]}: {a_label} {a:.3g}; best {sel_b.partition(':')[0]}: "
                f"{b_label} {b:.3g}", None)
    if spec.get("each"):
        return _ratio_each(target, summary, skipped, records)
    sel_a, sel_b = spec["ratio"]
    a_rows, b_rows = select(summary, sel_a), select(summary, sel_b)
    metric_b = spec.get("metric_b", metric)
    b_values = [(k, v[metric_b]) for k, v in b_rows if v.get(metric_b)]
    if not a_rows or not b_values or a_rows[0][1].get(metric) is None:
        return None, _missing([sel_a, sel_b], summary, skipped), None
    a_label, a = a_rows[0]
    b_label, b_value = max(b_values, key=lambda kv: kv[1]) if spec.get("agg_b") == "max" else b_values[0]
    value = a[metric] / b_value
    interval, said = _interval(records, a_label, b_label, metric, metric_b)
    detail = f"{a_label} / {b_label} ({metric}" + (f" / {metric_b}" if metric_b != metric else "")
    detail += (f"; {said})" if said else ")")
    if spec.get("per_question"):
        pq = spec["per_question"]
        b_row = summary[b_label]
        detail += f"; per question: {_fmt_x(a[pq] / b_row[pq] if a.get(pq) and b_row.get(pq) else None)}"
    if spec.get("agg_b") == "max" and len(b_values) > 1:
        detail += f"; vs the smallest {metric_b}: {_fmt_x(a[metric] / min(v for _, v in b_values))}"
    return value, detail, interval


def _side(interval: tuple[float, float], op: str, threshold: float) -> str:
    """Whether the whole interval meets the target, misses it, or spans the threshold."""
    lo, hi = interval
    meets = hi <= threshold if op == "<=" else lo >= threshold
    misses = lo > threshold if op == "<=" else hi < threshold
    return "the whole interval meets it" if meets else "the whole interval misses it" if misses else \
        "the interval spans the threshold"


def evaluate_targets(summary: Summary, skipped: dict[str, str], micro: dict[str, Any] | None,
                     targets: list[Target] | None = None,
                     records: Sequence[Record] | None = None, dataset: str | None = None) -> list[dict[str, Any]]:
    """Every target met / missed / not evaluated (with why), in file order.

    ``records`` (the run's per-question records) add each ratio's bootstrap interval
    (``interval``) and say whether the verdict holds over the whole of it. ``dataset``: the
    run's dataset; a target set on other datasets is ``"reported"``, not met or missed.
    """
    out = []
    for t in targets if targets is not None else load_targets():
        if "throughput" in t.value:  # measured by `ensemble bench --throughput` (bench.throughput), not per question
            continue
        value, detail, interval = compute(t, summary, skipped, micro, records)
        if value is None:
            out.append({"id": t.id, "issue": t.issue, "target": t.text, "value": None, "threshold": t.threshold,
                        "status": "not evaluated", "detail": detail or "no data", "interval": None})
            continue
        met = value <= t.threshold if t.op == "<=" else value >= t.threshold
        status = "met" if met else "missed"
        if dataset is not None and t.datasets and dataset not in t.datasets:
            status = "reported"
            detail += f"; the target is set on {' and '.join(t.datasets)}, this run is on {dataset}"
        elif interval is not None:
            detail += f"; {_side(interval, t.op, t.threshold)}"
        out.append({"id": t.id, "issue": t.issue, "target": t.text, "value": round(value, 4),
                    "threshold": t.threshold, "status": status, "detail": detail,
                    "interval": None if interval is None else [round(interval[0], 4), round(interval[1], 4)]})
    return out
