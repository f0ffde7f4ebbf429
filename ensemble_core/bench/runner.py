"""Options, runners, rows and the interleaved driver of ``ensemble bench``.

Every method runs on the same questions, *interleaved* per question in one process, so
that machine load, caches and thermal state affect all methods alike.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ensemble_core.bench.datasets import DEFAULT_SHOTS, Problem, cot_prompt, load_dataset
from ensemble_core.bench.microbench import verify_microbench
from ensemble_core.bench.records import RESULTS_FILE, Row, RunOutput, error_record, jsonable, make_record, summarize_rows
from ensemble_core.bench.report import cpu_ticks, hardware, member_layouts, steal_share, write_markdown, write_plots
from ensemble_core.bench.targets import evaluate_targets
from ensemble_core.decoding.members import Member
from ensemble_core.decoding.stats import MemberStats, RequestStats
from ensemble_core.ensemble import DEFAULT_MEMBERS, Ensemble, resolve_members
from ensemble_core.errors import ConfigurationError, EnsembleError, InvalidOptionError, UnknownOptionError
from ensemble_core.methods import METHODS, config_fields, method_class
from ensemble_core.models.loading import per_member_options
from ensemble_core.text.alignment import decode

ALL_METHODS = tuple(METHODS)


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
    members: tuple[str, ...] = DEFAULT_MEMBERS
    devices: tuple[str, ...] = ()
    dtype: str | tuple[str, ...] = "auto"  # one dtype for all members or one per member
    quantize: tuple[str | None, ...] = ()  # one scheme for all members or one per member ("none" / "int8")
    prepack: bool | None = None  # a prepacked copy of float32 CPU weights (None: when it fits; products.py)
    passes: str = "eager"  # how members run their passes: eager, static or graphs (decoding/static.py)
    #: tokens of recent prompts' KV states per member: off, because the rows share their members and would find
    #: each other's prompts prefilled (``flags.TIMED_PREFIX_CACHE``)
    prefix_cache: int = 0
    max_new_tokens: int = 256
    #: Same for every method: a base model answering through the fallback transcript goes on
    #: to invent the next "Question:" after answering; its answer is then not the last number.
    stop: tuple[str, ...] = ("\nQuestion:",)
    every_token_distributions: tuple[str, ...] = ("unite",)
    safe_drafters: tuple[int, ...] | None = None  # None: every member in turn
    #: Member subsets (indices) ensembled as well, in the same interleaved run: the ensemble
    #: rows of the whole set come first, then each subset's (e.g. the pairs of a trio).
    subsets: tuple[tuple[int, ...], ...] = ()
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
        self.quantize = tuple(self.quantize)
        if self.quantize and len(self.quantize) not in (1, len(self.members)):
            raise InvalidOptionError("quantize", list(self.quantize),
                                     f"one scheme for all members or one per member ({len(self.members)})")
        if self.safe_drafters is not None:
            bad_d = [d for d in self.safe_drafters if not 0 <= d < len(self.members)]
            if bad_d:
                raise InvalidOptionError("safe_drafters", list(self.safe_drafters),
                                         f"member indices in 0..{len(self.members) - 1}")
        self.subsets = tuple(tuple(sub) for sub in self.subsets)
        bad_s = [list(sub) for sub in self.subsets
                 if len(sub) < 2 or len(set(sub)) != len(sub) or not all(0 <= i < len(self.members) for i in sub)]
        if bad_s:
            raise InvalidOptionError("subsets", bad_s, f"subsets of at least two distinct member indices in "
                                     f"0..{len(self.members) - 1}, e.g. --subsets 0,2 1,2")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidOptionError("threads", self.threads, "an integer >= 1 or None")
        if not isinstance(self.microbench_reps, int) or self.microbench_reps < 1:
            raise InvalidOptionError("microbench_reps", self.microbench_reps, "an integer >= 1")


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
        ids = member.encode_messages(member.messages(prompt))  # as a request encodes it (control strings as text)
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
                         finish_reason=finish,
                         stats=RequestStats("single", len(new), len(new), [MemberStats(member.name, "member")]).as_dict(),
                         time_to_l=times[self.l_tokens - 1] if len(times) >= self.l_tokens else None, token_ids=new)


class EnsembleRunner:
    """A registry method (SAFE, SpecEM, every-token, generate-then-select) through :class:`Ensemble`."""

    def __init__(self, ensemble: Ensemble, kind: str) -> None:
        self.ensemble = ensemble
        self.kind = kind

    def run(self, prompt: list[dict[str, str]], max_new_tokens: int) -> RunOutput:
        r = self.ensemble.generate(prompt, max_new_tokens=max_new_tokens)
        return RunOutput(text=r.text, seconds=r.seconds, tokens=r.completion_tokens, ttft=r.time_to_first_chunk,
                         finish_reason=r.finish_reason, stats=jsonable(r.stats))


def method_overrides(method: str, method_config: Mapping[str, Mapping[str, Any]],
                     stop: Sequence[str] = ()) -> dict[str, Any]:
    """Config overrides for ``method`` from ``--set`` entries (``{"*": {...}, "safe": {...}}``):
    the ``*`` ones where ``method``'s config has the field, then the method's own; ``stop``
    when given."""
    fields = config_fields(method)
    chosen = {k: v for k, v in method_config.get("*", {}).items() if k in fields}
    chosen.update(method_config.get(method, {}))
    if stop:
        chosen["stop"] = tuple(stop)
    return chosen


def check_method_config(method_config: Mapping[str, Mapping[str, Any]], methods: Sequence[str],
                        prefixes: Sequence[str]) -> None:
    """Raise early for ``--set`` entries nothing would use or no config accepts (a typo would otherwise be silent):

    * a ``method.`` prefix outside ``prefixes``;
    * a plain key that no config of ``methods`` has (also when none of them takes a config);
    * a name or a value that the config of ``methods`` or of a prefix refuses, by the configs' own
      check (:meth:`GenerationConfig.replace`, as ``ensemble generate`` and ``serve`` check ``--set``).

    A method that is not available in this installation is left out (its row says so when it runs).
    """
    for key in method_config:
        if key != "*" and key not in prefixes:
            raise InvalidOptionError("--set prefix", key, "a method name among " + ", ".join(prefixes))
    plain = method_config.get("*", {})
    available: list[str] = []
    known: set[str] = set()
    for m in methods:
        try:
            known |= config_fields(m)
        except ConfigurationError:
            continue
        available.append(m)
    unknown = sorted(set(plain) - known)
    if unknown and not methods:
        raise ConfigurationError(
            f"--set {', '.join(unknown)}: none of the benchmarked methods takes a method config (the single rows run "
            "each member through transformers' generate). Drop --set, or add an ensemble method to --methods.")
    if unknown and available:
        raise UnknownOptionError(unknown, "--set", known, f"No benchmarked method ({', '.join(available)}) has such "
                                 f"a config field; known: {', '.join(sorted(known))}.")
    for m in dict.fromkeys([*available, *(k for k in method_config if k != "*")]):
        try:
            config_class = method_class(m).config_class
        except ConfigurationError:
            continue
        config_class().replace(**method_overrides(m, method_config))


def check_available(options: BenchOptions) -> None:
    """Raise early for ``--set`` entries no requested method uses or accepts (the single rows run the
    members through transformers directly: no method config reaches them), and for the options that
    the command sets for every row itself."""
    for name, flag in (("max_new_tokens", "--max-new-tokens"), ("stop", "--stop")):
        if any(name in values for values in options.method_config.values()):
            raise ConfigurationError(f"--set {name}: the benchmark sets {name} for every row itself; "
                                     f"use {flag} instead (it applies to the single rows too).")
    check_method_config(options.method_config, [m for m in options.methods if m != "single"], ALL_METHODS[1:])


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

    groups = [tuple(range(len(members)))] + [tuple(sub) for sub in options.subsets]
    for method in options.methods:
        if method == "single":
            for m in members:
                add(f"single[{m.name}]", "single", lambda m=m: HFSingleRunner(m, options.stop, l_tokens), member=m.name)
            continue
        try:
            base = method_overrides(method, options.method_config, options.stop)
        except ConfigurationError as exc:
            rows.append(Row(method, method, skipped=str(exc)))
            continue
        for group in groups:
            ms = [members[i] for i in group]
            names = tuple(m.name for m in ms)
            tag = "" if group == groups[0] else subset_tag(names)
            if method == "every-token":
                for dist in options.every_token_distributions:
                    cfg = {**base, "distribution": dist}
                    add(f"every-token[{dist}{tag}]", method, ensemble(method, ms, **cfg), config=cfg, members=names)
            elif method == "safe":
                wanted = options.safe_drafters if options.safe_drafters is not None else group
                for i in [i for i in group if i in wanted]:
                    cfg = {**base, "drafter": group.index(i)}
                    add(f"safe[drafter={members[i].name}{tag}]", method, ensemble(method, ms, **cfg),
                        drafter=members[i].name, config=cfg, members=names)
            else:
                label = method if not tag else f"{method}[{tag.removeprefix('; ')}]"
                add(label, method, ensemble(method, ms, **base), config=base, members=names)
    return rows


def subset_tag(names: Sequence[str]) -> str:
    """``"; members=smollm2+qwen2.5"``: a subset's row-label suffix, by the names' first words when unique."""
    short = [n.split("-")[0] for n in names]
    return "; members=" + "+".join(short if len(set(short)) == len(short) else names)


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


# ============================================================================ driver
def _load_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _warm_up(rows: list[Row]) -> None:
    """One tiny generation per row and the ensembles' token tables, so one-time costs (kernels, allocator,
    tables) stay out of the timings (a 4-token answer need not reach a point where the members disagree)."""
    for row in rows:
        if row.runner is None:
            continue
        try:
            if isinstance(row.runner, EnsembleRunner):
                row.runner.ensemble.warm_up()
            row.runner.run([{"role": "user", "content": "What is 2 + 3?"}], 4)
        except Exception as exc:  # noqa: BLE001 - a broken method is reported per question below
            print(f"warm-up of {row.label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def check_writable(out: Path) -> None:
    """Create the results folder ``out`` and make sure a file can be written there, before any model loads."""
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is an existing file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename and str(exc.filename) != str(out) else ""
        raise ConfigurationError(f"Cannot write the results to {out}: {where}{exc.strerror or exc}. "
                                 "Pass --out a folder that can be created and written to.") from exc


def run_bench(options: BenchOptions, members: list[Member] | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``options`` and write every artefact; returns the summary."""
    from tqdm.auto import tqdm

    check_available(options)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    out = Path(options.out)
    check_writable(out)
    problems = load_dataset(options.dataset, options.limit, options.offset, options.data_path)
    n_shots = options.shots if options.shots is not None else DEFAULT_SHOTS.get(options.dataset, 0)
    shots: list[Problem] = []
    if n_shots:
        pool = load_dataset(options.dataset, path=options.data_path)
        chosen_ids = {p.id for p in problems}
        shots = [p for p in reversed(pool) if p.id not in chosen_ids][:n_shots]  # from the far end, never overlapping
    if members is None:
        member_options = per_member_options(len(options.members), options.dtype, options.devices, options.quantize,
                                            options.prepack, options.passes, options.prefix_cache)
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
                ticks = cpu_ticks()
                try:
                    record = make_record(row, problem, row.runner.run(prompt, options.max_new_tokens))
                    record["cpu_steal"] = steal_share((ticks, cpu_ticks()))
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
    stolen = [r["cpu_steal"] for r in records if r.get("cpu_steal") is not None]
    summary = {
        "meta": {"dataset": options.dataset, "questions": len(problems), "offset": options.offset,
                 "cpu_steal": {"mean": round(statistics.fmean(stolen), 4), "max": max(stolen),
                               "records": len(stolen)} if stolen else None,
                 "members": [m.name for m in members], "layouts": member_layouts(members),
                 "max_new_tokens": options.max_new_tokens, "shots": n_shots,
                 "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "command": options.command or "run_bench(...)", "hardware": hardware(),
                 "options": jsonable(dataclasses.asdict(options))},
        "methods": methods, "skipped": skipped, "microbench": micro,
        "targets": evaluate_targets(methods, skipped, micro, records=records, dataset=options.dataset),
    }
    if options.plots:
        summary["plots"] = write_plots(out, labels, records)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
    write_markdown(out / "summary.md", summary)
    return summary
