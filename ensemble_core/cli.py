"""The ``ensemble`` command: ``demo``, ``generate``, ``bench`` and ``serve``.

* ``ensemble demo``: each member alone vs their SAFE ensemble on a fixed set of arithmetic
  questions (a table: correct or not, tokens/s, E/T), then one streamed ensemble answer with
  its statistics (:mod:`ensemble_core.demo`).
* ``ensemble generate``: any members, any method, config flags (``--lookahead``,
  ``--segment-length``, ``--distribution``, ``--drafter`` or generic ``--set key=value``),
  a prompt or a chat file, optionally streamed.
* ``ensemble bench``: the benchmark harness (:mod:`ensemble_core.bench`).
* ``ensemble serve``: an OpenAI-compatible HTTP server (:mod:`ensemble_core.server`, docs/serving.md).

Only argparse: the command adds no dependency.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ensemble_core import demo as _demo
from ensemble_core.bench.datasets import DATASETS
from ensemble_core.ensemble import DEFAULT_MEMBERS, Ensemble
from ensemble_core.errors import EnsembleError, InputError, InvalidOptionError
from ensemble_core.flags import (
    TIMED_PREFIX_CACHE,
    add_load_flags,
    add_member_flags,
    load_members,
    parse_sets,
    parse_value,
    prepack_flag,
)
from ensemble_core.methods import METHODS, method_class
from ensemble_core.server.cli import add_serve_parser

#: ``ensemble demo``'s choices live in :mod:`ensemble_core.demo` (with why); these names keep them reachable from here.
DEMO_QUESTION = _demo.STREAM_QUESTION  # streamed at the end; its answer is demo.STREAM_ANSWER
DEMO_STOP = _demo.STOP  # the benchmark's stop string: a model otherwise goes on to invent the next "Question:"
DEMO_MEMBERS = _demo.DEMO_MEMBERS
DEMO_CPU_QUESTIONS = _demo.CPU_QUESTIONS
DEMO_GPU_QUESTIONS = _demo.GPU_QUESTIONS


# ---------------------------------------------------------------------------- output helpers
def format_stats(stats: dict[str, Any]) -> list[str]:
    """Readable lines for a method's stats dict (see :mod:`ensemble_core.decoding.stats`; E/T first when reported)."""
    lines = []
    if "e_t" in stats:
        lines.append(f"E/T (ensembled / total tokens): {stats['e_t']:.1%}")
    for key, value in stats.items():
        if key == "e_t":
            continue
        if key == "members":
            for v in value:
                lines.append(f"{v['name']} ({v['role']}): {v['forward_passes']} forward passes, "
                             f"{v['tokens_fed']} tokens fed, {v['seconds']:.2f} s")
            continue
        if isinstance(value, float):
            value = round(value, 3)
        elif isinstance(value, dict):
            value = {k: round(v, 3) if isinstance(v, float) else v for k, v in value.items()}
        elif isinstance(value, list) and len(value) > 12:
            value = f"[{len(value)} values: {value[:3]} ... {value[-3:]}]"
        lines.append(f"{key}: {value}")
    return lines


# ---------------------------------------------------------------------------- commands
def cmd_demo(args: argparse.Namespace) -> int:
    """``ensemble demo``: members alone vs their SAFE ensemble on fixed questions, then one streamed answer
    (:mod:`ensemble_core.demo` says which questions and members, and why)."""
    return _demo.run_demo(args, format_stats)


def _read_prompt(args: argparse.Namespace) -> Any:
    if args.prompt is not None:
        return args.prompt
    path = Path(args.chat_file)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"Cannot read the chat file {path}: {exc}") from exc
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 BOM (PowerShell's `Out-File -Encoding utf8`) is fine
    except UnicodeDecodeError as exc:
        utf16 = raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
        why = "it is UTF-16, which Windows PowerShell 5's `>` writes" if utf16 else str(exc)
        raise InputError(f"The chat file {path} is not UTF-8 text ({why}). Save it as UTF-8: in PowerShell "
                         "`... | Out-File -Encoding utf8 FILE`, elsewhere `iconv -t UTF-8`.") from exc
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"The chat file {path} is not JSON ({exc}); it must hold a list of "
                         "{'role', 'content'} messages.") from exc
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    return messages


def generate_config(args: argparse.Namespace) -> dict[str, Any]:
    """Method config from the dedicated flags and ``--set`` (dedicated flags win)."""
    sets = parse_sets(args.set)
    extra = [k for k in sets if k != "*"]
    if extra:
        raise InvalidOptionError("--set", extra, "plain key=value for generate (no method prefix)")
    config: dict[str, Any] = dict(sets.get("*", {}))
    config["max_new_tokens"] = args.max_new_tokens
    for flag in ("lookahead", "segment_length", "distribution", "drafter", "seed"):
        value = getattr(args, flag)
        if value is not None:
            config[flag] = value
    if args.stop:
        config["stop"] = tuple(args.stop)
    if args.sample:
        config["do_sample"] = True
    return config


def _emit(text: str, end: str = "\n") -> bool:
    """Print ``text`` to stdout at once; False when its reader has gone (a BrokenPipeError: ``... | head``)."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        return False
    return True


def _stdout_closed() -> int:
    """The reader of stdout closed it (``ensemble generate --stream ... | head -c 20``): exit quietly.

    stdout now points at os.devnull, so that Python's flush of the unwritten rest at exit does not
    raise again ("Exception ignored ... BrokenPipeError"; the idiom of the Python docs' note on
    SIGPIPE). The status is 141 (128 + SIGPIPE), what a shell reports for ``cat``, ``seq`` or
    ``yes`` in the same pipeline, which die of SIGPIPE: not 0, because the output was cut short,
    and not 1 or 2, which mean a failure or bad input.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file descriptor (replaced in-process): nothing will flush to it
        pass
    return 141  # 128 + SIGPIPE (13)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    config = generate_config(args)
    method_class(args.method).config_class().replace(**config)  # bad options fail before any model loads
    members = load_members(args)
    ensemble = Ensemble(members, method=args.method, **config)
    if args.stream:
        stream = ensemble.stream(prompt)
        for delta in stream:
            if not _emit(delta, end=""):  # the reader went away (`| head`): stop the generation, not run it to its end
                stream.cancel()
                for _ in stream:  # ends at the next round with finish_reason "cancelled"
                    pass
                return _stdout_closed()
        if not _emit(""):
            return _stdout_closed()
        result = stream.result
    else:
        result = ensemble.generate(prompt)
        if not _emit(result.text):
            return _stdout_closed()
    if args.json:
        if not _emit(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                                 "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                                 "seconds": result.seconds, "time_to_first_chunk": result.time_to_first_chunk,
                                 "stats": result.stats.as_dict()}, default=repr)):
            return _stdout_closed()
    elif not args.quiet:
        print(f"\n[{ensemble.name}: {result.seconds:.2f} s, {result.completion_tokens} tokens, finish={result.finish_reason}]",
              file=sys.stderr)
        for line in format_stats(result.stats):
            print("  " + line, file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    """argparse type of ``demo --questions``: a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1, e.g. 5")
    return value


def _index_subset(text: str) -> tuple[int, ...]:
    """``"0,2"`` -> ``(0, 2)`` (argparse type of ``--subsets``)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of member indices, e.g. 0,2") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from ensemble_core.bench import ALL_METHODS, BenchOptions, run_bench
    from ensemble_core.bench.runner import check_writable

    members = list(args.members or DEFAULT_MEMBERS)
    if args.throughput:
        from ensemble_core.bench.throughput import THROUGHPUT_METHODS, ThroughputOptions, run_throughput

        methods = THROUGHPUT_METHODS if args.methods == list(ALL_METHODS) else tuple(args.methods)
        out = Path(args.out if args.out != "results/bench" else "results/throughput")
        throughput = ThroughputOptions(
            methods=methods, members=tuple(members), devices=tuple(args.device or ()), dtype=tuple(args.dtype),
            quantize=tuple(args.quantize or ()), prepack=prepack_flag(args.prepack), passes=args.passes,
            prefix_cache=args.prefix_cache, concurrency=tuple(args.concurrency),
            max_new_tokens=args.max_new_tokens if args.max_new_tokens != 256 else 64, dataset=args.dataset,
            data_path=args.data_path, offset=args.offset, sequential_requests=args.sequential,
            stop=tuple(args.stop) if args.stop is not None else BenchOptions.stop, out=str(out), threads=args.threads,
            warmup=not args.no_warmup, baseline_process=not args.inline_baseline, repeats=args.repeats,
            method_config=parse_sets(args.set),
            command="ensemble " + " ".join(shlex.quote(a) for a in args.argv))
        check_writable(out)  # before any model loads (run_bench checks its own folder)
        run_throughput(throughput)
        print((out / "throughput.md").read_text(encoding="utf-8"))
        print(f"Results in {out.resolve()}")
        return 0
    options = BenchOptions(
        dataset=args.dataset, data_path=args.data_path, limit=args.limit, offset=args.offset, shots=args.shots,
        methods=tuple(args.methods), members=tuple(members), devices=tuple(args.device or ()), dtype=tuple(args.dtype),
        quantize=tuple(args.quantize or ()), prepack=prepack_flag(args.prepack), passes=args.passes,
        prefix_cache=args.prefix_cache, max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop) if args.stop is not None else BenchOptions.stop,
        every_token_distributions=tuple(args.every_token_distributions),
        safe_drafters=tuple(args.safe_drafters) if args.safe_drafters is not None else None,
        subsets=tuple(args.subsets or ()), method_config=parse_sets(args.set), out=args.out, resume=args.resume,
        warmup=not args.no_warmup,
        plots=not args.no_plots, microbench=not args.no_microbench, microbench_reps=args.microbench_reps,
        progress=not args.no_progress, threads=args.threads, command="ensemble " + " ".join(shlex.quote(a) for a in args.argv))
    summary = run_bench(options)
    out = Path(args.out)
    print((out / "summary.md").read_text(encoding="utf-8"))
    print(f"Results in {out.resolve()}")
    errors = sum(v["errors"] for v in summary["methods"].values())
    return 1 if errors else 0


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from ensemble_core.bench import ALL_METHODS

    parser = argparse.ArgumentParser(prog="ensemble", description="Training-free LLM ensembles (SAFE, SpecEM).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="each member alone vs their SAFE ensemble on fixed arithmetic questions (a table), "
                                     "then one streamed ensemble answer")
    p.add_argument("--members", nargs="+", metavar="MEMBER", default=None,
                   help=f"members to compare (default: {' '.join(DEMO_MEMBERS)}, the bundled pair that can do arithmetic)")
    add_load_flags(p, TIMED_PREFIX_CACHE)
    p.add_argument("--quick", action="store_true", help="one question only (the first of the table's set), no extra stream")
    p.add_argument("--questions", type=_positive_int, default=None,
                   help=f"how many of the arith set's first questions the table asks (default {DEMO_CPU_QUESTIONS}, "
                        f"{DEMO_GPU_QUESTIONS} with --device cuda)")
    p.add_argument("--question", default=None, help="the question the ensemble streams at the end (default: the farmer question)")
    p.add_argument("--max-new-tokens", type=int, default=_demo.STREAM_TOKENS,
                   help=f"length cap of the streamed answer (default {_demo.STREAM_TOKENS})")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster when other processes share the cores)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate with any members and method")
    add_member_flags(p)
    p.add_argument("--method", default="safe", choices=sorted(METHODS))
    p.add_argument("--max-new-tokens", type=int, default=256)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--chat-file", help='JSON file with a list of {"role", "content"} messages')
    p.add_argument("--stream", action="store_true", help="print text as it is committed")
    p.add_argument("--lookahead", type=int, default=None, help="SAFE: tokens drafted per round")
    p.add_argument("--segment-length", type=int, default=None, help="SpecEM: segment length L")
    p.add_argument("--distribution", default=None, help="SAFE / every-token: unite or gac")
    p.add_argument("--drafter", type=parse_value, default=None, help="SAFE: drafter member (index or name)")
    p.add_argument("--stop", nargs="+", default=None, help="stop strings")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any method config field (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result and stats as JSON after the text")
    p.add_argument("--quiet", action="store_true", help="print the text only")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmark methods on a dataset (interleaved per question)")
    add_member_flags(p, prefix_cache=TIMED_PREFIX_CACHE)
    p.add_argument("--dataset", default="gsm8k", choices=sorted(DATASETS))
    p.add_argument("--data-path", default=None, help="GSM8K test.jsonl to read instead of the vendored copy")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--shots", type=int, default=None,
                   help="few-shot examples, taken from the end of the dataset (default: gsm8k 0, arith 2)")
    p.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    p.add_argument("--every-token-distributions", nargs="+", default=["unite"], choices=["unite", "gac"])
    p.add_argument("--safe-drafters", nargs="+", type=int, default=None,
                   help="member indices to use as SAFE drafter, one row each (default: every member)")
    p.add_argument("--subsets", nargs="+", type=_index_subset, default=None, metavar="I,J[,K]",
                   help="also ensemble these member subsets in the same run, e.g. --subsets 0,2 1,2 for the pairs "
                        "of a trio with the last member (every ensemble method, one row each)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", nargs="*", default=None,
                   help="stop strings for every method (default: '\\nQuestion:'; give none to disable)")
    p.add_argument("--set", action="append", metavar="[METHOD.]KEY=VALUE",
                   help="method config override, e.g. --set specem.segment_length=8 or --set lookahead=4")
    p.add_argument("--out", default="results/bench", help="results folder")
    p.add_argument("--resume", action="store_true", help="keep results.jsonl and run only what is missing")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-microbench", action="store_true", help="skip the verify-in-line microbenchmark")
    p.add_argument("--microbench-reps", type=int, default=5)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; use 1 when other processes share the cores)")
    p.add_argument("--throughput", action="store_true",
                   help="instead: total tokens/s of concurrent requests (batched) vs one after another "
                        "(default methods single, safe, specem; 64 new tokens; see bench.throughput)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16],
                   help="--throughput: numbers of concurrent requests to measure")
    p.add_argument("--sequential", type=int, default=None,
                   help="--throughput: at most this many prompts run one after another for each level's "
                        "baseline, half before and half after its batched run (default: as many as the level)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--throughput: measure every level this many times, each bracketed by its own baseline, "
                        "and report the median (with the spread: a busy or virtual machine's speed drifts)")
    p.add_argument("--inline-baseline", action="store_true",
                   help="--throughput: run the one-by-one baseline in this process (default: a worker process "
                        "of its own, so that neither side inherits the other's allocator and thread state)")
    p.set_defaults(func=cmd_bench)
    add_serve_parser(sub)  # ``ensemble serve``; FastAPI is imported only when it runs
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args) or 0)
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
