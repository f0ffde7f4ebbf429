"""Throughput of concurrent requests (``ensemble bench --throughput``): batched vs one after another.

For each method (single model, SAFE, SpecEM by default) the same GSM8K prompts run

* **concurrently**, ``c`` at a time through ``Ensemble.batch`` (batching on), for every
  ``c`` in ``concurrency``;
* **one after another** with batching off (each request alone: the throughput a caller got
  before cross-request batching), the same first ``c`` prompts (at most
  ``sequential_requests``), half of them just before the batched run and half just after.
  Each level brackets its own baseline because this machine's speed drifts over minutes
  (measured: the same batched SpecEM run took 35 s and, half an hour later, 59 s), so a
  baseline measured once at the start compared levels with a different machine.
  The one-by-one requests run in a worker process of their own (``baseline_process``,
  loaded once per method): in one process, the batched SpecEM run took 57.6 s right after
  four unbatched requests and 48.1 s fresh, so a shared process charged the batched side
  for what the baseline left behind (allocator and thread-pool state).

With ``repeats`` > 1 every level is measured that many times, each bracketed by its own
baseline, and the median repeat is reported with the others' speed-ups next to it (how far
one verdict can be trusted on a machine whose speed drifts).

Reported per method and ``c``: total output tokens per second both ways and their ratio
(the speed-up the targets in ``targets.json`` are about), the mean per-request latency
both ways (what one caller pays for sharing passes), how many model calls the batcher made
for how many rows, the seconds per call of each member (which pass stops scaling with
rows) and whether the texts equal the unbatched ones. Output tokens are counted with each
method's primary member's tokenizer, as everywhere else.
"""

from __future__ import annotations

import datetime as _dt
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.bench.records import jsonable
from ensemble_core.bench.report import cpu_ticks, hardware, member_layouts, steal_share
from ensemble_core.bench.runner import check_method_config, method_overrides
from ensemble_core.bench.targets import load_targets
from ensemble_core.decoding.members import Member
from ensemble_core.decoding.scheduler import BatchingConfig
from ensemble_core.ensemble import Ensemble, resolve_members
from ensemble_core.errors import EnsembleError, InvalidOptionError
from ensemble_core.methods import METHODS, method_class
from ensemble_core.models.loading import MemberSpec, per_member_options
from ensemble_core.models.products import is_prepacked
from ensemble_core.options import check_int, is_int

THROUGHPUT_METHODS = ("single", "safe", "specem")


@dataclass
class ThroughputOptions:
    """Everything one throughput run depends on (recorded in ``throughput.json``)."""

    methods: tuple[str, ...] = THROUGHPUT_METHODS
    members: tuple[str, ...] = ("smollm2-135m-instruct", "gemma3-270m")
    #: How ``members`` load (as :class:`~ensemble_core.bench.BenchOptions`): one value for all
    #: or one per member; the baseline process loads them the same way.
    devices: tuple[str, ...] = ()
    dtype: str | tuple[str, ...] = "auto"
    quantize: tuple[str | None, ...] = ()
    prepack: bool | None = None
    passes: str = "eager"  # eager, static or graphs (decoding/static.py)
    prefix_cache: int = 0  # tokens of recent prompts' KV states per member: off, as in the benchmark (runner.py)
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    max_new_tokens: int = 64
    dataset: str = "gsm8k"
    data_path: str | None = None
    offset: int = 0
    stop: tuple[str, ...] = ("\nQuestion:",)
    latency_at: int = 8
    #: At most this many prompts run one after another for each level's baseline (None: as many
    #: as the level runs at once). A level above it is compared with the rate of its first
    #: ``sequential_requests`` prompts (marked "est.").
    sequential_requests: int | None = None
    out: str = "results/throughput"
    threads: int | None = None
    warmup: bool = True
    #: Run the one-by-one baseline in a worker process of its own (it loads ``members`` from
    #: their specs once per method), so that neither side inherits the other's allocator and thread
    #: state. Members passed in as objects cannot be re-loaded there: they run in this process.
    baseline_process: bool = True
    #: Measure every level this many times (each repeat bracketed by its own baseline) and report
    #: the median repeat. Why: on a shared or virtual machine one measurement of a level moved
    #: by 1.6x between runs of the same code (x8 SAFE 1.62-2.42x over six runs, larger
    #: hypervisor steal in the slower ones); the spread of repeats in one run says how far a
    #: verdict can be trusted.
    repeats: int = 1
    #: Method config overrides, as ``ensemble bench --set``: ``{"*": {...}}`` for every method
    #: whose config has the field, ``{"safe": {...}}`` for one (e.g. SAFE's ``prompt_lookup``).
    #: Both sides of every level run with them: the speed-up compares batching, not settings.
    method_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    command: str = ""

    def __post_init__(self) -> None:
        self.methods, self.concurrency = tuple(self.methods), tuple(sorted(set(self.concurrency)))
        if not self.concurrency or not all(is_int(c) and c >= 1 for c in self.concurrency):
            raise InvalidOptionError("concurrency", list(self.concurrency), "integers >= 1")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        if not self.methods:
            raise InvalidOptionError("methods", [], "at least one method")
        check_int("repeats", self.repeats, 1)
        self.method_config = {key: dict(values) for key, values in (self.method_config or {}).items()}
        check_method_config(self.method_config, self.methods, tuple(METHODS))
        for method in self.methods:  # a bad value fails here, before any member loads
            method_class(method).config_class().replace(**method_overrides(method, self.method_config))


def _members_for(method: str, members: list[Member]) -> list[Member]:
    return members[:1] if method == "single" else members


def _stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in ("model_calls", "batched_calls", "rows", "real_tokens", "padded_tokens",
                                                  "slab_in_place", "slab_rebuilt")}
    out["per_member"] = {}
    for name, calls in after["calls_by_member"].items():
        calls -= before["calls_by_member"].get(name, 0)
        seconds = after["seconds_by_member"].get(name, 0.0) - before["seconds_by_member"].get(name, 0.0)
        rows = after["rows_by_member"].get(name, 0) - before["rows_by_member"].get(name, 0)
        out["per_member"][name] = {"calls": calls, "rows": rows, "rows_per_call": round(rows / calls, 2) if calls else None,
                                   "ms_per_call": round(1000 * seconds / calls, 1) if calls else None}
    return out


Timed = tuple[int, float, str]  # (completion tokens, seconds, text) of one request alone


def output_differences(batched: list[str], alone: list[str]) -> list[dict[str, int]]:
    """Where each differing pair of outputs parts: ``{"request", "common_chars", "chars"}``.

    Why: "identical 5/8" does not say whether a greedy choice flipped at the first token or
    at the last; the shared prefix does (the batching issue bounds such flips to under one
    token in 200). ``chars`` is the one-by-one output's length.
    """
    out = []
    for i, (a, b) in enumerate(zip(batched, alone)):
        if a != b:
            common = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"request": i, "common_chars": common, "chars": len(b)})
    return out


def _warm_up(ensemble: Ensemble) -> None:
    """One short request and the members' token tables, so that neither side's first timed request pays
    for lazy set-up (a short request need not reach the first point where members disagree, which
    builds the tables: the batched side then built them inside its timed run)."""
    ensemble.generate([{"role": "user", "content": "What is 2 + 3?"}], max_new_tokens=4)
    ensemble.warm_up()


def _one_by_one(ensemble: Ensemble, prompts: list[Any]) -> list[Timed]:
    """Each prompt alone, in order: (completion tokens, seconds, text)."""
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        r = ensemble.generate(prompt)
        out.append((r.completion_tokens, time.perf_counter() - t0, r.text))
    return out


def _baseline_worker(conn: Any, specs: list[MemberSpec], method: str, common: dict[str, Any], threads: int | None,
                     warmup: bool) -> None:
    """The worker process of :class:`ProcessBaseline`: load once, then answer prompt lists."""
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        alone = Ensemble(resolve_members(specs), method=method, batching=False, **common)
        if warmup:
            _warm_up(alone)
        conn.send(("ready", (os.getpid(), member_layouts(alone.members))))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which re-raises it
        conn.send(("error", exc))
        return
    while (prompts := conn.recv()) is not None:
        try:
            conn.send(("ok", _one_by_one(alone, prompts)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", exc))


class InlineBaseline:
    """One-by-one requests in this process (members passed in as objects)."""

    def __init__(self, members: list[Member], method: str, common: dict[str, Any], warmup: bool) -> None:
        self.ensemble = Ensemble(members, method=method, batching=False, **common)
        self.pid = os.getpid()
        self.dtypes = member_layouts(self.ensemble.members)
        if warmup:
            _warm_up(self.ensemble)

    def run(self, prompts: list[Any]) -> list[Timed]:
        return _one_by_one(self.ensemble, prompts)

    def close(self) -> None:
        pass


class ProcessBaseline:
    """One-by-one requests in a spawned worker process that loads the members by name once."""

    def __init__(self, specs: list[MemberSpec], method: str, common: dict[str, Any], threads: int | None,
                 warmup: bool) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no state shared with this one
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_baseline_worker, args=(child, specs, method, common, threads, warmup),
                                    name=f"throughput-baseline-{method}", daemon=True)
        self._process.start()
        child.close()
        self.pid, self.dtypes = self._receive()

    def _receive(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise EnsembleError(
                f"the one-by-one baseline process (pid {self._process.pid}) exited with code "
                f"{self._process.exitcode} before answering; rerun with baseline_process=False "
                "(it then runs in this process) to see the error") from None
        if kind == "error":
            raise value
        return value

    def run(self, prompts: list[Any]) -> list[Timed]:
        self._conn.send(prompts)
        return self._receive()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()  # our own worker, by its handle
            self._process.join()
        self._conn.close()


def measure_method(method: str, members: list[Member], prompts: list[Any], options: ThroughputOptions,
                   progress: Any = None, specs: list[MemberSpec] | None = None) -> dict[str, Any]:
    """One method: each concurrency level batched, bracketed by its one-by-one baseline.

    With ``specs`` (how to load ``members``) and ``options.baseline_process`` the baseline
    runs in a worker process; otherwise here. ``progress(result_so_far)`` is called after
    every level (the caller writes partial results).
    """
    ms = _members_for(method, members)
    common = {"max_new_tokens": options.max_new_tokens, "stop": tuple(options.stop),
              **method_overrides(method, options.method_config)}
    if specs is not None and options.baseline_process:
        alone: InlineBaseline | ProcessBaseline = ProcessBaseline(
            _members_for(method, list(specs)), method, common, options.threads, options.warmup)
    else:
        alone = InlineBaseline(ms, method, common, options.warmup)
    try:
        return _measure_levels(method, ms, prompts, options, alone, common, progress)
    finally:
        alone.close()


def _measure_levels(method: str, ms: list[Member], prompts: list[Any], options: ThroughputOptions,
                    alone: InlineBaseline | ProcessBaseline, common: dict[str, Any], progress: Any) -> dict[str, Any]:
    together = Ensemble(ms, method=method, batching=BatchingConfig(max_batch_rows=max(options.concurrency)), **common)
    if options.warmup:
        _warm_up(together)
    levels: dict[str, Any] = {}
    result = {"members": [m.name for m in ms], "levels": levels,
              "baseline": "process" if alone.pid != os.getpid() else "inline",
              "dtypes": member_layouts(ms), "baseline_dtypes": alone.dtypes}
    for c in options.concurrency:
        runs = [_measure_once(together, alone, prompts, c, options) for _ in range(options.repeats)]
        levels[str(c)] = median_repeat(runs)
        lv = levels[str(c)]
        print(f"{method} x{c}: {lv['tokens_per_s']:.2f} tok/s batched vs {lv['sequential_tokens_per_s']:.2f} alone "
              f"({lv['speedup']}x" + (f", median of {len(runs)}" if len(runs) > 1 else "") + ")",
              file=sys.stderr, flush=True)
        if progress is not None:
            progress(result)
    return result


def _measure_once(together: Ensemble, alone: InlineBaseline | ProcessBaseline, prompts: list[Any], c: int,
                  options: ThroughputOptions) -> dict[str, Any]:
    """One measurement of level ``c``: half the baseline, the batched run, the other half."""
    baseline = prompts[:min(c, options.sequential_requests or c)]
    half = (len(baseline) + 1) // 2
    ticks = [cpu_ticks()]
    seq = alone.run(baseline[:half])
    ticks.append(cpu_ticks())
    batcher = together.method.batcher
    assert batcher is not None
    before = batcher.stats.as_dict()
    t0 = time.perf_counter()
    results = together.batch(prompts[:c])
    wall = time.perf_counter() - t0
    after = batcher.stats.as_dict()
    ticks.append(cpu_ticks())
    seq += alone.run(baseline[half:])
    ticks.append(cpu_ticks())
    seq_tokens, seq_seconds = sum(t for t, _, _ in seq), sum(s for _, s, _ in seq)
    tokens = sum(r.completion_tokens for r in results)
    batched_rate = tokens / wall if wall else 0.0
    seq_rate = seq_tokens / seq_seconds if seq_seconds else 0.0
    return {
        "requests": c, "tokens": tokens, "seconds": round(wall, 3),
        "tokens_per_s": round(batched_rate, 3), "sequential_tokens_per_s": round(seq_rate, 3),
        "speedup": round(batched_rate / seq_rate, 3) if seq_rate else None,
        "mean_latency_s": round(statistics.mean(r.seconds for r in results), 3),
        "sequential_mean_latency_s": round(seq_seconds / len(seq), 3), "baseline_requests": len(seq),
        "identical_outputs": sum(r.text == s[2] for r, s in zip(results, seq)),
        "differences": output_differences([r.text for r in results], [s[2] for s in seq]),
        "batcher": _stats_delta(after, before),
        "cpu_steal": {"batched": steal_share((ticks[1], ticks[2])),
                      "one_by_one": steal_share((ticks[0], ticks[1]), (ticks[2], ticks[3]))},
    }


def median_repeat(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A level's report from its repeats: the repeat with the median speed-up (the lower one of an
    even count, so that every figure of the level is one real measurement), with every repeat's
    speed-up, rates and steal under ``repeats`` when there are several."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda r: -1.0 if r["speedup"] is None else r["speedup"])
    level = dict(ranked[(len(ranked) - 1) // 2])
    level["repeats"] = [{k: r[k] for k in ("speedup", "tokens_per_s", "sequential_tokens_per_s", "identical_outputs",
                                           "cpu_steal")} for r in runs]
    return level


def evaluate_throughput_targets(results: dict[str, Any], latency_at: int) -> list[dict[str, Any]]:
    """The ``throughput`` targets of ``targets.json`` against this run."""
    out = []
    for t in load_targets():
        spec = t.value
        if "throughput" not in spec:
            continue
        method, c = spec["throughput"], str(spec.get("concurrency", latency_at))
        level = results.get(method, {}).get("levels", {}).get(c)
        value = level.get(spec.get("metric", "speedup")) if level else None
        if value is None:
            out.append({"id": t.id, "issue": t.issue, "target": t.text, "value": None, "threshold": t.threshold,
                        "status": "not evaluated", "detail": f"no {method} row at concurrency {c}"})
            continue
        met = value <= t.threshold if t.op == "<=" else value >= t.threshold
        detail = f"{method} at {c} concurrent requests" + _repeats_note(level, spec.get("metric", "speedup"),
                                                                         t.op, t.threshold)
        out.append({"id": t.id, "issue": t.issue, "target": t.text, "value": value, "threshold": t.threshold,
                    "status": "met" if met else "missed", "detail": detail})
    return out


def _repeats_note(level: dict[str, Any], metric: str, op: str, threshold: float) -> str:
    """``"; median of 3 repeats (1.65-2.42x), met in 2 of 3"``; empty for one measurement."""
    values = [r.get(metric) for r in level.get("repeats", [])]
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return ""
    met = sum(v <= threshold if op == "<=" else v >= threshold for v in values)
    return (f"; median of {len(level['repeats'])} repeats ({min(values):.2f}-{max(values):.2f}x), "
            f"met in {met} of {len(values)}")


def _parted(differences: list[dict[str, int]] | None) -> str:
    """`` (parted at chars 12/230, 97/251)`` for the table; empty when every output was identical."""
    if not differences:
        return ""
    return " (parted at chars " + ", ".join(f"{d['common_chars']}/{d['chars']}" for d in differences) + ")"


def _stolen(steal: dict[str, float | None] | None) -> str:
    """``"2 % / 31 %"``: the hypervisor's share of the CPU while each side ran (– where unknown)."""
    if not steal:
        return "–"
    return " / ".join("–" if v is None else f"{v:.0%}" for v in (steal.get("batched"), steal.get("one_by_one")))


def markdown(summary: dict[str, Any]) -> str:
    """The throughput table, the latency cost, the per-member pass costs and the targets."""
    config = summary.get("meta", {}).get("options", {}).get("method_config")
    lines = [f"Method config (both sides): `{json.dumps(config, sort_keys=True)}`", ""] if config else []
    lines += ["| method | concurrent | tok/s batched | tok/s one by one | speed-up | mean latency batched / alone (s) "
             "| model calls / rows | ms per call (per member) | identical outputs | CPU stolen batched / alone |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for method, res in summary["results"].items():
        for c, lv in res["levels"].items():
            b = lv["batcher"]
            per = "; ".join(f"{name}: {m['ms_per_call']} ms × {m['rows_per_call']} rows"
                            for name, m in b["per_member"].items())
            est = "" if lv["baseline_requests"] >= lv["requests"] else f" (est. from {lv['baseline_requests']})"
            speedup = "–" if lv["speedup"] is None else f"{lv['speedup']:.2f}x"
            spread = [r["speedup"] for r in lv.get("repeats", []) if r["speedup"] is not None]
            if len(spread) > 1:
                speedup += f" ({min(spread):.2f}-{max(spread):.2f}, {len(lv['repeats'])} runs)"
            lines.append(f"| {method} | {c} | {lv['tokens_per_s']:.2f} | {lv['sequential_tokens_per_s']:.2f}{est} "
                         f"| {speedup} | {lv['mean_latency_s']:.1f} / {lv['sequential_mean_latency_s']:.1f} "
                         f"| {b['model_calls']} / {b['rows']} | {per} "
                         f"| {lv['identical_outputs']}/{min(lv['requests'], lv['baseline_requests'])}"
                         f"{_parted(lv.get('differences'))} | {_stolen(lv.get('cpu_steal'))} |")
    lines += ["", "| target | value | status |", "|---|---:|---|"]
    for t in summary["targets"]:
        value = "–" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"| {t['target']} | {value} | {t['status']} ({t['detail']}) |")
    return "\n".join(lines) + "\n"


def run_throughput(options: ThroughputOptions, members: list[Member] | None = None) -> dict[str, Any]:
    """Run the throughput benchmark and write ``throughput.json`` / ``throughput.md`` to ``options.out``."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    n = max(options.concurrency)
    problems = load_dataset(options.dataset, n, options.offset, options.data_path)
    prompts = [cot_prompt(p.question) for p in problems]
    specs = None
    if members is None:
        specs = [MemberSpec(name, **opts) for name, opts in zip(options.members, per_member_options(
            len(options.members), options.dtype, options.devices, options.quantize, options.prepack, options.passes,
            options.prefix_cache))]
        members = resolve_members(specs)
        # the baseline process loads with this process's decisions: where memory decided, it could decide otherwise
        specs = [replace(s, prepack=is_prepacked(m.model)) if s.prepack is None else s for s, m in zip(specs, members)]
    results: dict[str, Any] = {}
    for method in options.methods:
        def partial(result: dict[str, Any], method: str = method) -> None:
            (out / "throughput.partial.json").write_text(json.dumps({**results, method: result}, indent=2))
        results[method] = measure_method(method, members, prompts, options, partial, specs)
    summary = {
        "meta": {"dataset": options.dataset, "questions": len(prompts), "max_new_tokens": options.max_new_tokens,
                 "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "command": options.command or "run_throughput(...)", "hardware": hardware(),
                 "torch_threads": torch.get_num_threads(), "options": jsonable(asdict(options))},
        "results": results,
        "targets": evaluate_throughput_targets(results, options.latency_at),
    }
    (out / "throughput.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    (out / "throughput.md").write_text(markdown(summary), encoding="utf-8")
    return summary
