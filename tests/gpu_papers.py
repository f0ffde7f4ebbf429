"""GPU benchmark at the papers' sizes (#38, item 3): 7-8B-shaped verifiers, 135M / 0.5B drafters.

Not collected by pytest (CI has no GPU); ``--dry`` (tiny shapes, on the CPU) runs in CI through
``tests/test_gpu_check.py`` so that the script still works when device time is spent. Run on a
lent GPU from the repository root (``../shared/gpu/README.md``)::

    bash .gpu/run.sh python3 tests/gpu_papers.py --tokenizers /tmp/g/tok --out $OUT/papers

Random weights of real shapes with the real tokenizers: honest for speed (a pass costs the same
whatever the weights are), silent on accuracy; every figure in the report says so. Written to
``OUT/gpu_papers.json`` after every step (a step cut by the command's time limit leaves the
others), and printed:

- ``bandwidth``: device-to-device copy bandwidth measured here (GB/s), for the floors below.
- ``members``: per shape, ms per token of a bare eager decode loop (forward + argmax with a
  dynamic cache), of ``model.generate`` with transformers' static cache (which transformers
  compiles on CUDA: the graphed reference), of the core's ``single`` method, and the
  memory-bound floor (weight bytes / bandwidth). The slope between two lengths, so the prefill
  does not count.
- ``methods``: per method, ms per output token next to its biggest member alone, CUDA
  synchronisations per token, peak memory: SAFE with every draft accepted (threshold 0) and with
  the defaults (random members disagree everywhere: a worst case, not a claim), every-token,
  SpecEM and generate-then-select on two 7-8B-class members.
- with ``--passes static graphs`` (:mod:`ensemble_core.decoding.static`): per member shape the
  core's ``single`` with those passes (``core_single_graphs_ms`` ...; ``core_single_graphs_steps16_ms``:
  graphed, 16 steps queued per read, ``steps_per_read``) and ``passes_<mode>``: the
  largest logit difference and greedy agreement against eager over every kind of pass
  (:func:`ensemble_core.testing.lockstep`; graphs against static should be 0: the same kernels),
  the captures, replays and fallback reasons; every method row again with graphed members
  (``<label>_graphs``). What decides whether "graphs" becomes the CUDA default.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import QUESTION, environment, run_step, sync, twin  # noqa: E402  (this folder: the 1B-class check's helpers)
from gpu_check import SHAPES as CHECK_SHAPES  # noqa: E402
from gpu_check import build as build_shape  # noqa: E402

from ensemble_core import Ensemble  # noqa: E402
from ensemble_core.bench.datasets import cot_prompt  # noqa: E402
from ensemble_core.bench.device_time import device_time  # noqa: E402
from ensemble_core.bench.host_reads import cuda_syncs  # noqa: E402
from ensemble_core.decoding.members import Member  # noqa: E402
from ensemble_core.testing import lockstep, random_ids  # noqa: E402

RANDOM = "random weights of real shapes: speed only, not accuracy"

SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {  # name: (bundled alias, tokenizer folder, shape)
    "qwen2.5-7b": ("qwen2.5-coder-0.5b-instruct", "qwen", dict(hidden=3584, layers=28, intermediate_size=18944,
                                                              num_attention_heads=28, num_key_value_heads=4)),
    "llama-3.1-8b": ("smollm2-135m-instruct", "smol", dict(hidden=4096, layers=32, intermediate_size=14336,
                                                          num_attention_heads=32, num_key_value_heads=8)),
    "gemma-3-4b": ("gemma3-270m", "gemma", dict(hidden=2560, layers=34, intermediate_size=10240,
                                               num_attention_heads=8, num_key_value_heads=4, head_dim=256)),
    "smollm2-135m": CHECK_SHAPES["drafter-135m"],
    "qwen2.5-0.5b": ("qwen2.5-coder-0.5b-instruct", "qwen", dict(hidden=896, layers=24, intermediate_size=4864,
                                                                num_attention_heads=14, num_key_value_heads=2)),
}
#: (label, method, member names, options): the issue's rows. Drafters share their verifier's tokenizer
#: where the papers' speculative setting does (0.5B Qwen for 7B Qwen), and cross it where SAFE does.
METHODS: list[tuple[str, str, tuple[str, ...], dict[str, Any]]] = [
    ("safe_threshold0_qwen0.5b_qwen7b", "safe", ("qwen2.5-0.5b", "qwen2.5-7b"), {"drafter": 0, "consensus_threshold": 0.0}),
    ("safe_threshold0_smol135m_llama8b", "safe", ("smollm2-135m", "llama-3.1-8b"),
     {"drafter": 0, "consensus_threshold": 0.0}),
    ("safe_default_smol135m_qwen7b", "safe", ("smollm2-135m", "qwen2.5-7b"), {"drafter": 0}),
    ("every_token_qwen7b_llama8b", "every-token", ("qwen2.5-7b", "llama-3.1-8b"), {}),
    ("specem_qwen7b_llama8b", "specem", ("qwen2.5-7b", "llama-3.1-8b"), {}),
    ("generate_then_select_qwen7b_llama8b", "generate-then-select", ("qwen2.5-7b", "llama-3.1-8b"), {}),
]


def weight_bytes(member: Member) -> int:
    return sum(p.numel() * p.element_size() for p in member.model.parameters())


def bandwidth(device: str, megabytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), best of 5."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def slope_ms(run: Callable[[int], None], tokens: int) -> float:
    """ms per token from the time of ``tokens`` and of a quarter as many (the prefill cancels)."""
    times = {}
    for n in (max(1, tokens // 4), tokens):
        run(n)  # warm-up of that length (a compile, the caches)
        sync()
        t0 = time.perf_counter()
        run(n)
        sync()
        times[n] = time.perf_counter() - t0
    short, long = sorted(times)
    return 1000 * (times[long] - times[short]) / (long - short)


def eager_loop(member: Member, ids: torch.Tensor) -> Callable[[int], None]:
    """A bare decode loop: forward + argmax on a dynamic cache, what any eager implementation pays."""
    def run(n: int) -> None:
        with torch.inference_mode():
            out = member.model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(n):
                out = member.model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return run


def static_generate(member: Member, ids: torch.Tensor) -> Callable[[int], None]:
    """transformers' static cache (compiled by ``generate`` on CUDA): the graphed reference."""
    def run(n: int) -> None:
        member.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              cache_implementation="static", pad_token_id=member.tokenizer.eos_token_id)
    return run


def core_single(member: Member, **options: Any) -> Callable[[int], None]:
    ensemble = Ensemble([member], method="single", **options)

    def run(n: int) -> None:
        ensemble.generate(cot_prompt(QUESTION), max_new_tokens=n)
    return run


def passes_check(member: Member, passes: str, steps: int) -> dict[str, Any]:
    """``passes`` against eager (and graphs against static) on every kind of pass, with the runner's counts."""
    other = twin(member, passes)
    prompt = random_ids(40, 0)
    against_eager = lockstep(member.start_from_ids(prompt), other.start_from_ids(prompt), steps)
    out: dict[str, Any] = {"vs_eager": vars(against_eager)}
    if passes == "graphs":
        static = twin(member, "static")
        out["vs_static"] = vars(lockstep(static.start_from_ids(prompt), other.start_from_ids(prompt), steps))
    runner = other.static
    if runner is not None:
        out |= {"counts": dict(runner.counts), "reasons": dict(runner.reasons)}
    return out


#: The member paths ``--paths`` chooses from (``static_generate`` compiles: minutes on a first run).
PATHS = ("eager", "static_generate", "core_single")


def member_speeds(member: Member, tokens: int, gbps: float, passes: tuple[str, ...] = (),
                  paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    ids = member.tokenizer(QUESTION, return_tensors="pt").input_ids.to(member.device)
    out: dict[str, Any] = {"weights_gb": weight_bytes(member) / 1e9, "note": RANDOM}
    out["floor_ms"] = 1000 * weight_bytes(member) / (gbps / 2 * 1e9)  # a pass reads the weights once
    makers: dict[str, Callable[[], Callable[[int], None]]] = {
        "eager": lambda: eager_loop(member, ids), "static_generate": lambda: static_generate(member, ids),
        "core_single": lambda: core_single(member)}
    chosen = [(f"{path}_ms", makers[path]) for path in paths]
    chosen += [(f"core_single_{mode}_ms", lambda mode=mode: core_single(twin(member, mode))) for mode in passes]
    if "graphs" in passes:  # 16 graphed steps queued per read (steps_per_read): the host runs ahead of the device
        chosen.append(("core_single_graphs_steps16_ms", lambda: core_single(twin(member, "graphs"), steps_per_read=16)))
    for key, make in chosen:
        try:
            out[key] = slope_ms(make(), tokens)
        except Exception as exc:  # noqa: BLE001 - one failed path does not hide the others
            out[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def method_speed(members: list[Member], method: str, tokens: int, **options: Any) -> dict[str, Any]:
    """ms per output token of one generation (after a warm-up), its syncs per token, peak memory."""
    ensemble = Ensemble(members, method=method, max_new_tokens=tokens, **options)
    prompt = cot_prompt(QUESTION)
    ensemble.generate(prompt, max_new_tokens=8)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    result = ensemble.generate(prompt)
    produced = max(1, result.stats.get("tokens", result.completion_tokens))
    with cuda_syncs() as syncs, device_time() as busy:  # counted and profiled: not timed
        counted = ensemble.generate(prompt, max_new_tokens=min(tokens, 32))
    counted_tokens = max(1, counted.stats.get("tokens", counted.completion_tokens))
    rounds = result.stats.get("rounds") or produced
    ms_per_token = 1000 * result.seconds / produced
    return {"ms_per_token": ms_per_token, "tokens": produced, "chars": len(result.text),
            "ms_per_round": 1000 * result.seconds / rounds,  # every-token: one round per fused piece
            "syncs_per_token": syncs["syncs"] / min(tokens, 32) if torch.cuda.is_available() else None,
            # near 1: the device sets the pace; far below: the host does (docs/gpu.md, "Busy or waiting")
            "device_busy_ms_per_token": busy.busy_ms / counted_tokens,
            "device_busy_share": busy.share(ms_per_token * counted_tokens), "device_busy_error": busy.error,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "stats": {k: result.stats.get(k) for k in ("e_t", "drafted", "accepted", "rounds", "prompt_lookup",
                                                         "draft_confidence")},
            "note": RANDOM}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/gpu-papers"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", nargs="*", help="method labels to run (default: all)")
    parser.add_argument("--passes", nargs="*", default=[], choices=["static", "graphs"],
                        help="also measure members and methods with these passes (ensemble_core.decoding.static)")
    parser.add_argument("--check-steps", type=int, default=24, help="lockstep steps of the passes check")
    parser.add_argument("--paths", nargs="*", default=list(PATHS), choices=PATHS,
                        help="member paths to time (static_generate compiles: minutes on a first run)")
    args = parser.parse_args()
    passes = tuple(args.passes)
    device = "cpu" if args.dry else "cuda"
    dtype = torch.float32 if args.dry else torch.bfloat16
    report: dict[str, Any] = {"env": environment(), "note": RANDOM}
    args.out.mkdir(parents=True, exist_ok=True)

    def step(key: str, fn: Callable[[], Any]) -> None:
        run_step(report, key, fn, args.out / "gpu_papers.json")

    step("bandwidth", lambda: {"gb_per_s": bandwidth(device, 64 if args.dry else 2048)})
    gbps = report["bandwidth"].get("gb_per_s") or 1.0
    members = {name: build_shape(name, args.tokenizers, device, dtype, args.dry, SHAPES) for name in SHAPES}
    for mode in passes:  # first: whether the passes are right at all, before their speed counts
        step(f"passes_{mode}", lambda mode=mode: {name: passes_check(m, mode, args.check_steps)
                                                  for name, m in members.items()})
    step("members", lambda: {name: member_speeds(m, args.tokens, gbps, passes, tuple(args.paths))
                             for name, m in members.items()})
    graphed = {name: twin(m, "graphs") for name, m in members.items()} if "graphs" in passes else {}
    for label, method, names, options in METHODS:
        if args.only and label not in args.only:
            continue
        biggest = max(names, key=lambda n: weight_bytes(members[n]))
        for suffix, pool, alone in (("", members, "core_single_ms"), ("_graphs", graphed, "core_single_graphs_ms")):
            if not pool:
                continue
            step(label + suffix, lambda names=names, method=method, options=options, biggest=biggest, pool=pool,
                 alone=alone: method_speed([pool[n] for n in names], method, args.tokens, **options)
                 | {"biggest_alone_ms": report["members"].get(biggest, {}).get(alone)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
