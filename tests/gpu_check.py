"""GPU check: speed, verify-in-line and placement with 1B-class random-weight members.

Not collected by pytest (CI has no GPU). Run it on a CUDA machine from the repository root::

    python tests/gpu_check.py --tokenizers DIR --out results/gpu

``DIR`` holds ``smol/`` and ``gemma/``: the bundled models' tokenizer files (the GGUF files
themselves are too big to ship to a lent GPU box; random weights are enough to measure
speed, because every forward pass costs the same whatever the weights are). ``--dry``
runs the same script on the CPU with tiny shapes, to check it before spending GPU time.

What it measures, written to ``OUT/gpu_check.json`` and printed:

- ``transfers``: CUDA synchronisations of 100 small host-to-device copies made with
  ``torch.tensor(..., device=)`` and with ``ensemble_core.transfer`` (``to_device``, ``fill``:
  pinned staging, non-blocking; expected 0).
- ``single``: greedy tokens/s of each member alone (``model.generate``).
- ``verify_inline``: inline vs separate scoring at 2/4/8 candidates (bf16 timings) and
  the largest score difference between the two in float32.
- ``safe_ceiling``: SAFE with the 135M-shaped drafter and a 1B verifier with ensembling
  switched off (threshold 0: every draft accepted), i.e. the speed SAFE reaches when the
  members agree, vs the verifier alone, with the defaults and with ``published=True`` (the
  drafting levers are CPU defaults; on CUDA both should match until the levers are measured
  there); plus one default-threshold run (random members disagree everywhere, so that one is
  a stress test of the ensemble path, not a speed claim). Every method run also reports
  ``syncs_per_token``: CUDA synchronisations per output token (``torch.cuda.set_sync_debug_mode``,
  counted in a second, untimed run; ``ensemble_core.bench.host_reads``), and ``reads_per_token``:
  the host reads of that run (``HostReads``: the code's count, the same on a CPU, where a dry run
  shows it; an upper bound of the synchronisations).
- ``specem``: time to first segment and total time with two 1B members.
- ``placement``: SAFE and SpecEM with the members on different devices (cuda and cpu).
- ``batching``: total tokens/s of 1 and 16 concurrent GSM8K requests vs the same requests
  one after another (``bench.throughput.measure_method``, each level bracketed by its
  baseline of at most 8 requests) for the 1B member alone, SAFE and SpecEM: the batching
  issue's GPU target is SAFE >= 6x at 16.

``--save DIR`` also writes two of the members as model folders, so that ``ensemble bench
--members DIR/drafter-135m DIR/gemma-1b --device cuda`` can run the harness unchanged.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ensemble_core import Ensemble  # noqa: E402
from ensemble_core.bench import verify_microbench  # noqa: E402
from ensemble_core.bench.datasets import cot_prompt, load_dataset  # noqa: E402
from ensemble_core.bench.device_time import device_time  # noqa: E402
from ensemble_core.bench.host_reads import HostReads, cuda_syncs  # noqa: E402
from ensemble_core.decoding.members import Member  # noqa: E402
from ensemble_core.decoding.verify_inline import score_candidates_inline, score_candidates_separately  # noqa: E402
from ensemble_core.testing import tiny_config  # noqa: E402
from ensemble_core.transfer import fill, to_device  # noqa: E402

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")

SHAPES = {  # name: (bundled alias whose tokenizer and architecture it takes, tokenizer folder, config fields)
    "drafter-135m": ("smollm2-135m-instruct", "smol", dict(hidden=576, layers=30, intermediate_size=1536,
                                                          num_attention_heads=9, num_key_value_heads=3)),
    "llama-1b": ("smollm2-135m-instruct", "smol", dict(hidden=2048, layers=16, intermediate_size=8192,
                                                      num_attention_heads=32, num_key_value_heads=8)),
    "gemma-1b": ("gemma3-270m", "gemma", dict(hidden=1152, layers=26, intermediate_size=6912,
                                              num_attention_heads=4, num_key_value_heads=1, head_dim=256)),
}


def build(name: str, tokenizers: Path, device: str, dtype: torch.dtype, dry: bool,
          shapes: dict | None = None) -> Member:
    """A random-weight member of that shape (``shapes``, default :data:`SHAPES`; ``dry``: tiny_config's small
    default shape), initialised on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    alias, folder, shape = (shapes or SHAPES)[name]
    tokenizer = AutoTokenizer.from_pretrained(tokenizers / folder, local_files_only=True)
    config = tiny_config(alias, tokenizer, max_position_embeddings=8192, **({} if dry else shape))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    # no prefix cache: the methods are timed against each other on the same prompts, and the second to run one
    # would find it prefilled (flags.TIMED_PREFIX_CACHE)
    return Member(model, tokenizer, name=name, prefix_cache=0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def single_speed(member: Member, tokens: int) -> dict:
    ids = member.tokenizer(QUESTION, return_tensors="pt").input_ids.to(member.device)
    member.model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    member.model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    sync()
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def inline_equality(member: Member) -> float:
    """Largest |inline - separate| over candidates of different lengths, in float32."""
    member.model.float()
    state = member.start([{"role": "user", "content": QUESTION}])
    state.score()
    texts = [" First", " In May she sold half as many clips", " The total is 48 + 24 = 72.", " So"]
    cands = [member.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    a = score_candidates_inline(state, cands)
    b = score_candidates_separately(state, cands)
    member.model.to(torch.bfloat16)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def run_method(members: list[Member], method: str, tokens: int, **config) -> dict:
    ens = Ensemble(members, method=method, max_new_tokens=tokens, **config)
    prompt = cot_prompt(QUESTION)
    ens.generate(prompt, max_new_tokens=4)  # warm-up
    sync()
    result = ens.generate(prompt)
    tokens = result.stats.get("tokens", result.completion_tokens)  # random weights may pick text-less special tokens
    with cuda_syncs() as syncs, HostReads() as reads, device_time() as busy:  # a second, counted run: not timed
        counted = ens.generate(prompt)
    counted_tokens = max(1, counted.stats.get("tokens", counted.completion_tokens))
    return {"tokens": tokens, "seconds": result.seconds,
            "tokens_per_s": tokens / result.seconds if result.seconds else None,
            "time_to_first_chunk": result.time_to_first_chunk, "finish_reason": result.finish_reason,
            "syncs_per_token": syncs["syncs"] / counted_tokens if torch.cuda.is_available() else None,
            "reads_per_token": round(reads.per_token(counted_tokens), 3),
            # the device's busy time per token (profiled run) over the timed run's ms per token: near 1, the
            # device sets the pace; far below, the host does (docs/gpu.md, "Busy or waiting")
            "device_busy_ms_per_token": busy.busy_ms / counted_tokens,
            "device_busy_share": busy.share(1000 * result.seconds * counted_tokens / max(1, tokens)),
            "device_busy_error": busy.error,
            "same_text_twice": counted.text == result.text,  # a seeded sampled request is reproducible on the device
            "stats": result.stats.as_dict(), "text_head": result.text[:80]}


def batching(members: dict[str, Member], tokens: int, levels: tuple[int, ...] = (1, 16), busy: bool = False) -> dict:
    """Batched vs one-by-one throughput per method (speed-up = ratio of total tokens/s); with ``busy``, also the
    device's busy share at the largest level (one more, profiled batch per method: asked for the graphed pool,
    where a replay launches in microseconds and the host's Python may bind; eager passes are launch-bound)."""
    from ensemble_core.bench.throughput import ThroughputOptions, measure_method

    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", max(levels))]
    options = ThroughputOptions(concurrency=levels, max_new_tokens=tokens, sequential_requests=8)
    runs = {"single": [members["llama-1b"]], "safe": [members["drafter-135m"], members["llama-1b"]],
            "specem": [members["llama-1b"], members["gemma-1b"]]}
    if busy:  # #38: each request's burst as one job of several steps, run by the scheduler a pass per step for all
        runs["single_steps16"] = runs["single"]
    out = {}
    for method, ms in runs.items():
        name = method.removesuffix("_steps16")
        config = {name: {"steps_per_read": 16}} if method.endswith("_steps16") else {}
        result = measure_method(name, ms, prompts, replace(options, methods=(name,), method_config=config))
        out[method] = {c: {k: lv[k] for k in ("speedup", "tokens_per_s", "sequential_tokens_per_s", "mean_latency_s",
                                              "sequential_mean_latency_s", "identical_outputs")}
                       | {"rows_per_call": {n: m["rows_per_call"] for n, m in lv["batcher"]["per_member"].items()}}
                       for c, lv in result["levels"].items()}
        top = out[method].get(max(levels)) or out[method].get(str(max(levels)))
        if busy and top and top.get("tokens_per_s"):  # whether the batch keeps the device busy or waits on the host
            top["device_busy_share"] = batch_busy_share(ms, name, prompts[:max(levels)], tokens, top["tokens_per_s"],
                                                        **config.get(name, {}))
    return out


def batch_busy_share(members: list[Member], method: str, prompts: list, tokens: int, tokens_per_s: float,
                     **config: Any) -> float | None:
    """The share of a batch's wall time the device computes: its busy time per output token in one profiled
    batch of ``prompts`` (:mod:`~ensemble_core.bench.device_time`) over the timed batch's (``tokens_per_s``)."""
    ens = Ensemble(members, method=method, max_new_tokens=tokens, **config)
    ens.batch(prompts[:2])  # warm-up
    with device_time() as busy:
        results = ens.batch(prompts)
    produced = max(1, sum(r.stats.get("tokens", r.completion_tokens) for r in results))
    return busy.share(1000 * produced / tokens_per_s)


#: A slot long enough for a prompt, the tokens and packed candidates (spans keep short contexts cheap).
SLOT_TOKENS = 1024


def transfers(device: str) -> dict:
    """Synchronisations of 100 small host-to-device copies each way: ``torch.tensor(..., device=)`` (what the
    code did), ``ensemble_core.transfer.to_device`` and ``fill`` (what it does: pinned staging, non-blocking)."""
    buffer = torch.zeros(64, dtype=torch.long, device=device)
    values = list(range(64))
    ways = {"torch.tensor(device=)": lambda: torch.tensor(values, device=device),
            "to_device": lambda: to_device(values, device),
            "fill": lambda: fill(buffer, torch.tensor(values))}
    counts = {}
    for name, copy in ways.items():
        with cuda_syncs() as seen:
            for _ in range(100):
                copy()
        counts[name] = seen.get("syncs", 0)
    ok = torch.equal(to_device(values, device).cpu(), torch.tensor(values))
    return {"syncs_per_100_copies": counts, "values_arrive": ok}


def twin(member: Member, passes: str) -> Member:
    """The same weights and tokenizer with its passes run ``passes`` (``ensemble_core.decoding.static``), no
    prefix cache (as :func:`build`'s members: a check that starts the same prompt twice compares full prefills)."""
    return Member(member.model, member.tokenizer, name=f"{member.name}-{passes}", passes=passes,
                  max_cache_len=SLOT_TOKENS, prefix_cache=0)


def environment() -> dict:
    """The versions and the GPU a report was measured with."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def run_step(report: dict, key: str, fn, out_file: Path) -> None:
    """One check into ``report[key]`` (its error instead: one failure hides no other), printed, and the
    report saved to ``out_file`` at once, so that a command stopped at its time limit keeps what it measured."""
    t0 = time.perf_counter()
    try:
        report[key] = fn()
    except Exception as exc:  # noqa: BLE001 - every check reports, one failure does not hide the others
        report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    print(f"== {key} ({time.perf_counter() - t0:.1f} s)\n{json.dumps(report[key], indent=1, default=str)}", flush=True)
    out_file.write_text(json.dumps(report, indent=2, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--reps", type=int, default=10, help="repetitions of the verify-in-line timings")
    parser.add_argument("--save", type=Path, help="also save drafter-135m and gemma-1b here (for `ensemble bench`)")
    parser.add_argument("--passes", nargs="*", default=[], choices=["static", "graphs"],
                        help="also measure batching with members whose passes run so (batching_<passes>)")
    parser.add_argument("--only", nargs="*", help="steps to run (default: all), e.g. batching batching_graphs")
    args = parser.parse_args()
    device = "cpu" if args.dry else "cuda"
    dtype = torch.float32 if args.dry else torch.bfloat16
    report: dict = {"env": environment()}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    def step(key: str, fn) -> None:
        if not args.only or key in args.only:
            run_step(report, key, fn, args.out / "gpu_check.json")

    step("transfers", lambda: transfers(device))
    members = {name: build(name, args.tokenizers, device, dtype, args.dry) for name in SHAPES}
    step("single", lambda: {n: single_speed(m, args.tokens) for n, m in members.items()})
    step("verify_inline", lambda: {
        "timing_bf16": verify_microbench([members["llama-1b"], members["gemma-1b"]], reps=args.reps, candidates=(2, 4, 8)),
        "max_abs_diff_fp32": {n: inline_equality(members[n]) for n in ("llama-1b", "gemma-1b")}})
    pair = [members["drafter-135m"], members["llama-1b"]]
    step("safe_ceiling", lambda: {  # the 135M shape drafts (by default the largest weight, the 1B, would)
        "safe_threshold0": run_method(pair, "safe", args.tokens, consensus_threshold=0.0, drafter=0),
        "safe_threshold0_published": run_method(pair, "safe", args.tokens, consensus_threshold=0.0, drafter=0,
                                                published=True),
        "safe_default_random_weights": run_method(pair, "safe", args.tokens // 2, drafter=0),
        "every_token_unite": run_method(pair, "every-token", args.tokens // 2)})
    step("specem", lambda: {"specem_two_1b": run_method([members["llama-1b"], members["gemma-1b"]], "specem",
                                                       args.tokens)})

    step("sampling", lambda: {  # #38: a sampled draft draws on the device and keeps its ids there, read once
        "single_sampled": run_method([members["llama-1b"]], "single", args.tokens, do_sample=True, seed=3),
        "single_sampled_steps16": run_method([members["llama-1b"]], "single", args.tokens, do_sample=True, seed=3,
                                             steps_per_read=16),
        "safe_published_sampled": run_method(pair, "safe", args.tokens, drafter=0, published=True, do_sample=True,
                                             seed=3)})

    def placement() -> dict:
        other = build("gemma-1b", args.tokenizers, "cpu", torch.float32, dry=True)  # tiny, on the CPU
        mixed = [members["drafter-135m"], other]
        tokens = min(32, args.tokens)  # a check that members on two devices work together, not a timing
        return {"devices": [str(m.device) for m in mixed], "safe": run_method(mixed, "safe", tokens),
                "specem": run_method(mixed, "specem", tokens)}

    step("placement", placement)
    step("batching", lambda: batching(members, args.tokens // 2))
    def pooled(mode: str) -> dict:
        """The batched pass over the static pool (captured per rows x tokens x span with graphs, on first use,
        while other requests' threads run: each twin's captures, replays and any bucket left uncaptured)."""
        twins = {n: twin(m, mode) for n, m in members.items()}
        out = batching(twins, args.tokens // 2, busy=True)
        out["passes"] = {n: {"counts": dict(t.static.counts), "reasons": dict(t.static.reasons)}
                         for n, t in twins.items() if t.static is not None}
        return out

    for mode in args.passes:
        step(f"batching_{mode}", lambda mode=mode: pooled(mode))
    if args.save:
        for name in ("drafter-135m", "gemma-1b"):
            members[name].model.save_pretrained(args.save / name)
            members[name].tokenizer.save_pretrained(args.save / name)
    if torch.cuda.is_available():
        report["env"]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
