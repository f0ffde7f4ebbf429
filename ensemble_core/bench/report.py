"""The benchmark's artefacts: ``summary.md`` and the PNG plots."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ensemble_core.bench.records import RESULTS_FILE, mean


def _fmt(value: Any, kind: str = "f") -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{value:.1%}"
    if kind == "x":
        return f"{value:.2f}x"
    return f"{value:.2f}"


def hardware() -> dict[str, Any]:
    """The machine a run was made on; the CPU's model, ISA and native bf16 too, because this
    project's machines change between sessions (AVX2 one day, AVX-512 with bf16 the next)
    and member costs change with them."""
    from ensemble_core.models.loading import cpu_has_native_bf16, cpu_model

    info = {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "processor": platform.processor(),
            "cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu_has_native_bf16()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


CpuTicks = tuple[int, int]  # (stolen, total) CPU ticks of the whole machine since boot


def cpu_ticks() -> CpuTicks | None:
    """The machine's stolen and total CPU ticks so far, from ``/proc/stat``; None where there is none.

    Why: on a virtual machine the hypervisor may run other guests on our cores ("steal" time).
    Wall-clock timings cannot see it (``top`` showed 50 % steal in a sample taken during a
    batched level that ran 3x slower than the same level a day earlier); every timed part of
    a benchmark records its share (:func:`steal_share`) so that a run says whether its
    machine was its own.
    """
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steal_share(*spans: tuple[CpuTicks | None, CpuTicks | None]) -> float | None:
    """The share of all CPU ticks in the ``(before, after)`` spans that the hypervisor took (0-1)."""
    stolen = total = 0
    for before, after in spans:
        if before is None or after is None:
            return None
        stolen, total = stolen + after[0] - before[0], total + after[1] - before[1]
    return round(stolen / total, 4) if total > 0 else None


def member_layouts(members: Sequence[Any]) -> list[str]:
    """Each member's parameter dtype, with ``+prepacked`` when its products read prepacked weights
    (``ensemble_core.models.products``): recorded with every run, since both change a member's speed."""
    from ensemble_core.models.products import is_prepacked

    return [str(getattr(m.model, "dtype", "?")).removeprefix("torch.") + ("+prepacked" if is_prepacked(m.model) else "")
            for m in members]


def _cpu_note(hw: dict[str, Any]) -> str:
    """``", CPU <model> (<ISA>, native bf16)"`` for the summary line; empty for records made before it was kept."""
    if "cpu_capability" not in hw:
        return ""
    return (f", CPU {hw.get('cpu_model') or '?'} ({hw['cpu_capability']}"
            + (", native bf16" if hw.get("native_bf16") else "") + ")")


def _members_note(meta: dict[str, Any]) -> str:
    """``"a (float32+prepacked), b (float32)"``; names only for records made before layouts were kept."""
    layouts = meta.get("layouts") or [None] * len(meta["members"])
    return ", ".join(name + (f" ({lay})" if lay else "") for name, lay in zip(meta["members"], layouts))


def _steal_note(steal: dict[str, Any] | None) -> list[str]:
    """The summary's line on the hypervisor's share of the CPU during the timed runs (none for older records)."""
    if not steal:
        return []
    return [f"- CPU stolen by the hypervisor while the {steal['records']} timed runs ran: mean {steal['mean']:.1%}, "
            f"most in one run {steal['max']:.1%} (a timing with a large share measured a busier machine)"]


def write_markdown(path: Path, summary: dict[str, Any]) -> None:
    meta = summary["meta"]
    lines = [f"# Benchmark: {meta['dataset']} ({meta['questions']} questions)", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- members: {_members_note(meta)}; max_new_tokens {meta['max_new_tokens']}; shots {meta['shots']}",
             f"- hardware: {meta['hardware']['platform']}, {meta['hardware']['cpu_count']} CPUs "
             f"({meta['hardware']['torch_threads']} torch threads), torch {meta['hardware']['torch']}"
             + _cpu_note(meta['hardware'])
             + (f", GPUs: {', '.join(meta['hardware']['gpus'])}" if meta['hardware'].get('gpus') else ""),
             *_steal_note(meta.get("cpu_steal")), "",
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
    lines += _weak_member_lines(summary["methods"])
    if summary["skipped"]:
        lines += ["## Skipped methods", ""] + [f"- **{k}**: {v}" for k, v in summary["skipped"].items()] + [""]
    lines += ["## Targets (from the issues; declared in ensemble_core/bench/targets.json)", "",
              "| target | value | threshold | status | detail |", "|---|---|---|---|---|"]
    for t in summary["targets"]:
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {t['threshold']} | **{t['status']}** | {t['detail']} |")
    micro = summary.get("microbench")
    if micro and "skipped" not in micro:
        lines += ["", f"Verify-in-line microbenchmark ({micro['reps']} repetitions, summed over members): {micro['detail']}."]
    lines += ["", "Plots: `latency_per_method.png`, `latency_vs_length.png`, `et_distribution.png`; "
              f"per-question records: `{RESULTS_FILE}`.", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _pct_points(value: float) -> str:
    return f"{100 * value:+.0f}"


def _weak_member_lines(methods: dict[str, Any]) -> list[str]:
    """The summary's section on ensembles against their best member (``vs_best_member`` of each row)."""
    checks = {label: v["vs_best_member"] for label, v in methods.items() if v.get("vs_best_member")}
    if not checks:
        return []
    lines = ["## Ensembles against their best member", "",
             "Accuracy of each ensemble minus that of its most accurate member alone, on the questions both answered, "
             "with the paired-bootstrap 95 % interval (percentage points). **below**: the whole interval is under 0, "
             "the ensemble is clearly worse than its best member; *lowered by*: members whose removal made the same "
             "method more accurate in this run (subset rows); *weaker alone*: the suspects.", "",
             "| ensemble | best member (accuracy) | ensemble accuracy | difference (95 % CI) | status | lowered by "
             "| weaker alone |", "|---|---|---|---|---|---|---|"]
    flagged = []
    for label, c in checks.items():
        ci = f" ({_pct_points(c['interval'][0])} to {_pct_points(c['interval'][1])})" if c["interval"] else ""
        diff = "–" if c["difference"] is None else _pct_points(c["difference"]) + ci
        status = c["status"] or "–"
        if c["accuracy"] < c["member_accuracy"]:
            flagged.append(label)
        lines.append(f"| {label} | {c['member']} ({_fmt(c['member_accuracy'], 'pct')}) | {_fmt(c['accuracy'], 'pct')} "
                     f"| {diff} | {'**below**' if status == 'below' else status} | {', '.join(c['lowered_by']) or '–'} "
                     f"| {', '.join(c['weaker']) or '–'} |")
    below = [label for label in flagged if checks[label]["status"] == "below"]
    lines += ["", f"Less accurate than their best member: {len(flagged)} of {len(checks)} ensemble rows"
              + (f"; clearly (the whole interval under 0): {', '.join(below)}" if below else "; none clearly")
              + ". A weak member is what `reliability` (default `prior`) weighs down; see docs/choosing.md.", ""]
    return lines


def write_plots(out: Path, labels: list[str], records: list[dict[str, Any]]) -> list[str]:
    """Latency per method (bar), latency vs output length (scatter), E/T distribution (histogram)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    written = []
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    means = [mean([r["latency_s"] for r in ok if r["method"] == lb]) or 0.0 for lb in labels]
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


