"""The benchmark harness: rows, records, summary, targets, artefacts.

Fast tests run the whole harness on tiny random-weight members (real tokenizers); the
``real`` test runs ``ensemble bench --limit 2`` on SmolLM2 + Gemma-3 (the two fastest bundled members) with
every method.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ensemble_core import methods as registry
from ensemble_core.bench import (
    BenchOptions,
    HFSingleRunner,
    Row,
    _TextStop,
    build_rows,
    check_available,
    cut_at_stop,
    ensemble_ratio,
    evaluate_targets,
    is_corrupted,
    load_targets,
    run_bench,
    summarize_rows,
)
from ensemble_core.bench.datasets import cot_prompt
from ensemble_core.bench.runner import subset_tag
from ensemble_core.cli import main
from ensemble_core.errors import ConfigurationError, InvalidOptionError

ARTEFACTS = ("results.jsonl", "summary.json", "summary.md", "latency_per_method.png", "latency_vs_length.png",
             "et_distribution.png")


def _rec(method: str, qid: str, latency: float, tokens: int = 10, correct: bool = True, et: float | None = None,
         ttft: float | None = 0.1, time_to_l: float | None = None, kind: str = "x", chars: int = 100) -> dict:
    stats = {} if et is None else {"tokens": tokens, "ensembled": round(et * tokens), "e_t": et}
    return {"method": method, "kind": kind, "question_id": qid, "latency_s": latency, "tokens": tokens,
            "chars": chars, "correct": correct, "ttft_s": ttft, "time_to_L_s": time_to_l, "et": et, "corrupted": False,
            "finish_reason": "eos", "stats": stats}


def _synthetic(safe_fast: float = 1.0, safe_slow: float = 4.2, every: float = 6.0, et: float = 0.1):
    rows = [Row("single[fast]", "single", runner=object(), member="fast"),
            Row("single[slow]", "single", runner=object(), member="slow"),
            Row("safe[drafter=fast]", "safe", runner=object(), drafter="fast"),
            Row("safe[drafter=slow]", "safe", runner=object(), drafter="slow"),
            Row("every-token[unite]", "every-token", runner=object()),
            Row("specem", "specem", runner=object()),
            Row("generate-then-select", "generate-then-select", skipped="ConfigurationError: not installed")]
    records = []
    for q in ("q1", "q2"):
        records += [_rec("single[fast]", q, 0.5, tokens=50, time_to_l=0.2),
                    _rec("single[slow]", q, 4.0, tokens=40, time_to_l=1.0, correct=q == "q1"),
                    _rec("safe[drafter=fast]", q, safe_fast, et=et), _rec("safe[drafter=slow]", q, safe_slow, et=et / 2),
                    _rec("every-token[unite]", q, every, et=1.0), _rec("specem", q, 3.0, ttft=1.2)]
    return rows, records


def test_summary_ratios_and_targets_from_records() -> None:
    rows, records = _synthetic()
    summary = summarize_rows(rows, records)
    assert "generate-then-select" not in summary
    assert summary["single[slow]"]["accuracy"] == 0.5 and summary["single[fast]"]["accuracy"] == 1.0
    assert summary["single[fast]"]["tokens_per_s"] == pytest.approx(100.0)
    assert summary["safe[drafter=fast]"]["ratio_to_drafter"] == pytest.approx(2.0)
    assert summary["safe[drafter=fast]"]["ratio_to_slow"] == pytest.approx(0.25)
    assert summary["safe[drafter=slow]"]["ratio_to_drafter"] == pytest.approx(1.05)
    assert summary["safe[drafter=fast]"]["et"] == pytest.approx(0.1)
    targets = {t["id"]: t for t in evaluate_targets(summary, {"generate-then-select": "x"}, {"speedup_4": 2.5})}
    trio = {k: targets.pop(k) for k in ("trio_safe_small_drafter_vs_biggest", "trio_safe_vs_every_token")}
    assert all(t["status"] == "not evaluated" and "needs rows" in t["detail"] for t in trio.values())  # named members
    assert {t["status"] for t in targets.values()} == {"met"}
    assert targets["safe_fast_drafter_vs_slow_member"]["value"] == pytest.approx(0.25)
    assert targets["safe_vs_every_token"]["value"] == pytest.approx(6.0)
    assert targets["specem_ttfs"]["value"] == pytest.approx(1.2)  # vs the slowest member's time to L tokens

    rows, records = _synthetic(safe_fast=3.0, safe_slow=5.0, every=6.0, et=0.4)
    targets = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, {"speedup_4": 1.5})}
    assert {t["status"] for t in targets.values()} - {"met", "not evaluated"} == {"missed"}
    assert targets["safe_fast_drafter_vs_slow_member"]["status"] == "missed"
    assert targets["safe_vs_every_token"]["status"] == "missed"
    assert targets["safe_slow_drafter_vs_itself"]["status"] == "missed"
    assert targets["safe_et"]["status"] == "missed"
    assert targets["verify_in_line_speedup"]["status"] == "missed"


def test_a_target_set_on_one_dataset_is_only_judged_there() -> None:
    """The trio's accuracy target is set on arith: on GSM8K its value is reported, not met or missed."""
    rows, records = _synthetic()
    summary = summarize_rows(rows, records)
    target = next(t for t in load_targets() if t.id == "trio_ensemble_accuracy")
    assert target.datasets == ("arith",)
    [on_arith] = evaluate_targets(summary, {}, None, targets=[target], dataset="arith")
    [on_gsm8k] = evaluate_targets(summary, {}, None, targets=[target], dataset="gsm8k")
    [unknown] = evaluate_targets(summary, {}, None, targets=[target])
    assert on_arith["status"] == unknown["status"] == "met" and on_arith["value"] == on_gsm8k["value"]
    assert on_gsm8k["status"] == "reported" and "set on arith, this run is on gsm8k" in on_gsm8k["detail"]
    others = [t for t in load_targets() if t.id != target.id]
    assert all(not t.datasets for t in others)  # the speed targets hold on every dataset
    assert [t["status"] for t in evaluate_targets(summary, {}, {"speedup_4": 2.5}, targets=others, dataset="gsm8k")] \
        == [t["status"] for t in evaluate_targets(summary, {}, {"speedup_4": 2.5}, targets=others, dataset="arith")]



def test_ratio_intervals_bootstrap_the_questions() -> None:
    """A ratio's interval resamples the questions both rows answered, pairing them; it brackets
    the value, shrinks to a point when every question has the same ratio, and is reproducible."""
    from ensemble_core.bench.intervals import describe, paired, ratio_interval

    recs = [_rec("a", f"q{i}", 2.0 * (i + 1), chars=100 + 10 * i) for i in range(30)]
    recs += [_rec("b", f"q{i}", (i + 1), chars=100 + 10 * i) for i in range(30)]
    recs += [{"method": "b", "question_id": "q99", "error": "RuntimeError: x"}, _rec("a", "q99", 1.0)]
    pairs = paired(recs, "a", "b")
    assert len(pairs) == 30 and all(a["question_id"] == b["question_id"] for a, b in pairs)  # q99: error in b
    assert ratio_interval(pairs, "s_per_100_chars") == pytest.approx((2.0, 2.0))  # 2x on every question
    assert ratio_interval(pairs, "no_such_metric") is None and ratio_interval(pairs[:1], "mean_latency_s") is None

    noisy = [_rec("a", f"q{i}", 1.0 + (i * 37 % 11) / 5, chars=50 + (i * 53 % 17) * 20) for i in range(40)]
    noisy += [_rec("b", f"q{i}", 1.5 + (i * 29 % 13) / 4, chars=50 + (i * 53 % 17) * 20) for i in range(40)]
    summary = summarize_rows([Row("a", "x", runner=object()), Row("b", "x", runner=object())], noisy)
    point = summary["a"]["s_per_100_chars"] / summary["b"]["s_per_100_chars"]
    pairs = paired(noisy, "a", "b")
    lo, hi = ratio_interval(pairs, "s_per_100_chars")
    assert lo < point < hi and hi - lo > 0.05
    assert ratio_interval(pairs, "s_per_100_chars") == (lo, hi)  # fixed seed
    narrow = ratio_interval(pairs, "s_per_100_chars", level=0.5)
    assert lo <= narrow[0] < narrow[1] <= hi
    assert describe((lo, hi), 40).startswith("95 % CI ") and describe(None, 40) == ""
    with pytest.raises(ValueError, match="level"):
        ratio_interval(pairs, "s_per_100_chars", level=1.5)

    # through the targets: every ratio target gets its interval and says where it lies
    rows, records = _synthetic()
    by_id = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, None, records=records)}
    fast = by_id["safe_fast_drafter_vs_slow_member"]
    assert fast["interval"] == pytest.approx([0.25, 0.25]) and "the whole interval meets it" in fast["detail"]
    assert "95 % CI 0.25-0.25x over 2 questions" in fast["detail"]
    assert by_id["specem_ttfs"]["interval"] == pytest.approx([1.2, 1.2])  # mean_ttft_s / mean_time_to_L_s
    assert by_id["safe_et"]["interval"] is None  # not a ratio
    rows, records = _synthetic(safe_fast=3.0)
    records = [dict(r, latency_s=r["latency_s"] * (1.1 if r["question_id"] == "q2" else 1.0))
               if r["method"] == "single[slow]" else r for r in records]  # the slow member: 4 s, then 4.4 s
    fast = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, None,
                                                 records=records)}["safe_fast_drafter_vs_slow_member"]
    assert fast["status"] == "missed" and fast["interval"] == pytest.approx([3 / 4.4, 0.75], abs=1e-4)
    assert "the whole interval misses it" in fast["detail"]
    records = [dict(r, latency_s=r["latency_s"] * (1.5 if r["question_id"] == "q2" else 1.0))
               if r["method"] == "single[slow]" else r for r in records]  # now 4 s, then 6.6 s: 0.45x-0.75x
    fast = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, None,
                                                 records=records)}["safe_fast_drafter_vs_slow_member"]
    assert "the interval spans the threshold" in fast["detail"]


def test_trio_targets_best_ensemble_accuracy_and_subset_rows(tiny_llama, tiny_gemma, tiny_qwen) -> None:
    """``--subsets`` adds each subset's ensemble rows after the whole set's; targets keep reading the whole set."""
    options = BenchOptions(members=("a", "b", "c"), methods=("single", "safe", "every-token", "specem"),
                           subsets=((0, 2),), safe_drafters=(0,))
    rows = build_rows([tiny_llama, tiny_gemma, tiny_qwen], options)
    tag = f"; members={tiny_llama.name}+{tiny_qwen.name}"  # "tiny-..." names: first words not unique
    assert subset_tag(["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]) == "; members=smollm2+qwen2.5"
    assert [r.label for r in rows] == [
        f"single[{tiny_llama.name}]", f"single[{tiny_gemma.name}]", f"single[{tiny_qwen.name}]",
        f"safe[drafter={tiny_llama.name}]", f"safe[drafter={tiny_llama.name}{tag}]",
        "every-token[unite]", f"every-token[unite{tag}]", "specem", f"specem[{tag[2:]}]"]
    assert all(r.skipped is None for r in rows)
    pair = rows[4].runner.ensemble
    assert [m.name for m in pair.members] == [tiny_llama.name, tiny_qwen.name] and rows[4].members == (
        tiny_llama.name, tiny_qwen.name)
    with pytest.raises(InvalidOptionError, match="subsets"):
        BenchOptions(members=("a", "b"), subsets=((0, 0),))
    with pytest.raises(InvalidOptionError, match="subsets"):
        BenchOptions(members=("a", "b"), subsets=((1, 2),))

    q, s = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
    named = [Row(f"single[{q}]", "single", runner=object(), member=q),
             Row(f"single[{s}]", "single", runner=object(), member=s),
             Row(f"safe[drafter={s}]", "safe", runner=object(), drafter=s),
             Row("every-token[unite]", "every-token", runner=object())]
    recs = [_rec(f"single[{q}]", "q", 2.0), _rec(f"single[{s}]", "q", 0.5), _rec(f"safe[drafter={s}]", "q", 1.5, et=0.1),
            _rec("every-token[unite]", "q", 4.0, et=1.0)]
    by_id = {t["id"]: t for t in evaluate_targets(summarize_rows(named, recs), {}, None)}
    assert by_id["trio_safe_small_drafter_vs_biggest"]["value"] == pytest.approx(0.75)  # vs Qwen, not the "slow" row
    assert by_id["trio_safe_vs_every_token"]["value"] == pytest.approx(4.0 / 1.5, abs=1e-4)  # values are rounded

    # with --subsets each member set has its SAFE row: the best one counts, every one is listed, and
    # SAFE is compared with every-token on the same members (not with the trio's every-token row)
    g, trio, pair = "gemma3-270m", (s, "gemma3-270m", q), (s, q)
    sets = [Row(f"single[{q}]", "single", runner=object(), member=q),
            Row(f"safe[drafter={s}]", "safe", runner=object(), drafter=s, members=trio),
            Row(f"safe[drafter={s}; pair]", "safe", runner=object(), drafter=s, members=pair),
            Row("every-token[unite]", "every-token", runner=object(), members=trio),
            Row("every-token[unite; pair]", "every-token", runner=object(), members=pair)]
    recs = [_rec(f"single[{q}]", "q", 2.0), _rec(f"safe[drafter={s}]", "q", 3.0, et=0.1),
            _rec(f"safe[drafter={s}; pair]", "q", 1.8, et=0.1), _rec("every-token[unite]", "q", 9.0, et=1.0),
            _rec("every-token[unite; pair]", "q", 3.0, et=1.0)]
    by_id = {t["id"]: t for t in evaluate_targets(summarize_rows(sets, recs), {}, None)}
    biggest, every = by_id["trio_safe_small_drafter_vs_biggest"], by_id["trio_safe_vs_every_token"]
    assert biggest["value"] == pytest.approx(0.9) and biggest["status"] == "met"
    assert "1.50x" in biggest["detail"] and "0.90x" in biggest["detail"] and g not in biggest["detail"]
    assert every["value"] == pytest.approx(3.0) and every["status"] == "met"  # trio 9 / 3; the pair's is 3 / 1.8
    assert "1.67x" in every["detail"] and "every-token[unite; pair] / safe[drafter=" in every["detail"]

    rows, records = _synthetic()
    records = [dict(r, correct=r["method"] == "specem") if r["method"].startswith(("single", "specem")) else r
               for r in records]
    targets = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, None)}
    acc = targets["trio_ensemble_accuracy"]
    assert acc["status"] == "met" and acc["value"] == pytest.approx(1.0) and "single[fast] 0" in acc["detail"]
    records = [dict(r, correct=r["method"].startswith("single[fast]")) for r in records]
    acc = {t["id"]: t for t in evaluate_targets(summarize_rows(rows, records), {}, None)}["trio_ensemble_accuracy"]
    assert acc["status"] == "missed" and acc["value"] == pytest.approx(-1.0)


def test_speed_ratios_are_per_output_character() -> None:
    """A member that answers in one line is not "fast" just because its answers are short."""
    rows = [Row("single[brief]", "single", runner=object(), member="brief"),
            Row("single[verbose]", "single", runner=object(), member="verbose"),
            Row("safe[drafter=verbose]", "safe", runner=object(), drafter="verbose")]
    records = [_rec("single[brief]", "q", 1.0, chars=20), _rec("single[verbose]", "q", 4.0, chars=400),
               _rec("safe[drafter=verbose]", "q", 5.0, chars=400, et=0.1)]
    summary = summarize_rows(rows, records)
    assert summary["single[brief]"]["s_per_100_chars"] == pytest.approx(5.0)
    assert summary["single[verbose]"]["ratio_to_slow"] == pytest.approx(0.2)  # verbose is the fast member
    safe = summary["safe[drafter=verbose]"]
    assert safe["ratio_to_drafter"] == pytest.approx(1.25) and safe["ratio_to_fast"] == pytest.approx(1.25)
    assert safe["latency_ratio_to_slow"] == pytest.approx(5.0) and safe["ratio_to_slow"] == pytest.approx(0.25)
    target = next(t for t in evaluate_targets(summary, {}, None) if t["id"] == "safe_fast_drafter_vs_slow_member")
    assert target["status"] == "met" and "per question: 5.00x" in target["detail"]


def test_targets_not_evaluated_say_why() -> None:
    rows = [Row("single[a]", "single", runner=object(), member="a"), Row("safe", "safe", skipped="ImportError: gone")]
    summary = summarize_rows(rows, [_rec("single[a]", "q", 1.0, kind="single")])
    targets = evaluate_targets(summary, {"safe": "ImportError: gone"}, {"skipped": "no verify_inline"})
    assert all(t["status"] == "not evaluated" for t in targets)
    assert any("ImportError: gone" in t["detail"] for t in targets)
    assert next(t for t in targets if t["id"] == "verify_in_line_speedup")["detail"] == "no verify_inline"


def test_record_helpers() -> None:
    assert is_corrupted("a\ufffdb") and is_corrupted("bad \ud800 surrogate") and not is_corrupted("東京 😀")
    assert ensemble_ratio({"e_t": 0.25}) == 0.25  # the typed stats' key; nothing else is guessed
    assert ensemble_ratio({"ensembled": 3, "tokens": 12}) is None
    assert ensemble_ratio({"tokens": 12}) is None and ensemble_ratio({"e_t": True}) is None
    assert cut_at_stop("abc\nUser: x", ["\nUser:"]) == ("abc", True)
    assert cut_at_stop("abc", ["\nUser:"]) == ("abc", False)


def test_steal_share_of_spans() -> None:
    """The hypervisor's share of the CPU over one or several (before, after) spans of /proc/stat ticks."""
    from ensemble_core.bench.report import cpu_ticks, steal_share

    assert steal_share(((10, 100), (15, 200))) == 0.05
    assert steal_share(((0, 0), (5, 100)), ((5, 300), (35, 400))) == 0.175  # 35 of 200 ticks
    assert steal_share(((10, 100), None)) is None and steal_share(((10, 100), (10, 100))) is None
    now = cpu_ticks()  # Linux (CI and here): the first line of /proc/stat
    assert now is not None and 0 <= now[0] <= now[1]


def test_text_stop_criterion_sees_only_the_response(tiny_gemma) -> None:
    tok = tiny_gemma.tokenizer
    prompt = tok("Question: what?\nAnswer:", add_special_tokens=False)["input_ids"]
    stop = _TextStop(tok, ["\nQuestion:"], len(prompt))
    assert not bool(stop(torch.tensor([prompt]), None)[0])  # the prompt's own "Question:" does not count
    going = prompt + tok(" 7 + 5 = 12.", add_special_tokens=False)["input_ids"]
    assert not bool(stop(torch.tensor([going]), None)[0])
    done = going + tok("\nQuestion: next", add_special_tokens=False)["input_ids"]
    assert bool(stop(torch.tensor([done]), None)[0])


def test_options_are_validated() -> None:
    with pytest.raises(InvalidOptionError):
        BenchOptions(methods=("single", "mbr"))
    with pytest.raises(InvalidOptionError):
        BenchOptions(every_token_distributions=("avg",))
    with pytest.raises(InvalidOptionError):
        BenchOptions(max_new_tokens=0)
    with pytest.raises(InvalidOptionError):
        BenchOptions(devices=("cpu", "cpu", "cpu"))
    with pytest.raises(InvalidOptionError):
        BenchOptions(safe_drafters=(2,))


def test_hf_single_matches_a_greedy_loop_over_the_member_api(tiny_llama) -> None:
    """The speed-limit row (HF generate) decodes exactly the greedy tokens of the member's own decode state."""
    prompt = cot_prompt("What is 2 + 3?")
    hf = HFSingleRunner(tiny_llama, l_tokens=4).run(prompt, 12)
    state = tiny_llama.start(prompt, 12)
    for _ in range(12):
        state.extend([int(state.score()[-1].argmax())])
    assert hf.token_ids == state.response_ids and hf.tokens == 12
    assert hf.text == tiny_llama.decode(state.response_ids).lstrip()
    assert hf.finish_reason == "length" and 0 < hf.ttft <= hf.time_to_l <= hf.seconds


def test_run_bench_writes_every_artefact_on_tiny_members(tiny_llama, tiny_gemma, tmp_path: Path) -> None:
    options = BenchOptions(dataset="arith", limit=2, max_new_tokens=4, out=str(tmp_path), progress=False,
                           every_token_distributions=("unite", "gac"), microbench_reps=1, warmup=False,
                           method_config={"specem": {"segment_length": 3}})
    summary = run_bench(options, members=[tiny_llama, tiny_gemma])
    for name in ARTEFACTS:
        assert (tmp_path / name).stat().st_size > 0, name
    labels = {f"single[{tiny_llama.name}]", f"single[{tiny_gemma.name}]", "every-token[unite]", "every-token[gac]",
              f"safe[drafter={tiny_llama.name}]", f"safe[drafter={tiny_gemma.name}]", "specem", "generate-then-select"}
    assert set(summary["methods"]) == labels and summary["skipped"] == {}
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * len(labels) and not [r for r in records if "error" in r]
    assert [r["question_id"] for r in records[: len(labels)]] == ["arith-0"] * len(labels)  # interleaved per question
    assert all(r["et"] is not None for r in records if r["kind"] in ("safe", "every-token"))
    assert len(summary["targets"]) == 9
    for t in summary["targets"]:  # random weights may write only whitespace: then a ratio has no data, and says so
        assert t["status"] in ("met", "missed") or (t["status"] == "not evaluated" and t["detail"]), t
    micro = next(t for t in summary["targets"] if t["id"] == "verify_in_line_speedup")
    assert micro["status"] in ("met", "missed")  # the microbenchmark always has data
    md = (tmp_path / "summary.md").read_text()
    assert "## Targets" in md and all(label in md for label in labels)
    hw = summary["meta"]["hardware"]  # the ISA is kept with every run: member costs follow it
    assert hw["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and isinstance(hw["native_bf16"], bool)
    assert f"({hw['cpu_capability']}" in md
    # and each member's dtype and whether it was prepacked (tiny members are built prepacked)
    assert summary["meta"]["layouts"] == ["float32+prepacked"] * 2
    assert f"{tiny_llama.name} (float32+prepacked)" in md
    assert summary["microbench"]["speedup_4"] > 0
    # each timed run says how much of the CPU the hypervisor took meanwhile (Linux: /proc/stat)
    assert all(0.0 <= r["cpu_steal"] <= 1.0 for r in records)
    assert summary["meta"]["cpu_steal"]["records"] == len(records) and "CPU stolen by the hypervisor" in md
    # --resume runs nothing twice
    again = run_bench(BenchOptions(**{**options.__dict__, "resume": True, "microbench": False}),
                      members=[tiny_llama, tiny_gemma])
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(records)
    assert again["methods"]["specem"]["questions"] == 2


def test_unavailable_method_is_reported_not_dropped(tiny_llama, tiny_gemma, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(registry.METHODS, "specem", "ensemble_core.not_there:Nope")
    summary = run_bench(BenchOptions(dataset="arith", limit=1, max_new_tokens=3, out=str(tmp_path), progress=False,
                                     methods=("single", "specem"), warmup=False, plots=False, microbench=False),
                        members=[tiny_llama, tiny_gemma])
    assert "specem" in summary["skipped"] and "not available" in summary["skipped"]["specem"]
    assert "## Skipped methods" in (tmp_path / "summary.md").read_text()
    ttfs = next(t for t in summary["targets"] if t["id"] == "specem_ttfs")
    assert ttfs["status"] == "not evaluated" and "not available" in ttfs["detail"]


def test_unknown_set_field_fails_early(tiny_llama, tiny_gemma, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="segmnt_length"):
        run_bench(BenchOptions(dataset="arith", limit=1, out=str(tmp_path), progress=False,
                               method_config={"*": {"segmnt_length": 3}}), members=[tiny_llama, tiny_gemma])


@pytest.mark.parametrize(("sets", "methods", "says"), [
    (["specem.segment_lenght=8"], ["specem"], "Unknown option(s) segment_lenght for SpecEMConfig"),  # a prefixed typo
    (["specem.segment_length=0"], ["specem"], "Invalid value for 'segment_length'"),  # a bad value: not a skipped row
    (["nosuch=1"], ["single"], "none of the benchmarked methods takes a method config"),
    (["segment_length=8"], ["single", "safe"], "Unknown option(s) segment_length for --set"),  # no requested method has it
    (["max_new_tokens=8"], ["safe"], "use --max-new-tokens instead"),  # it would clash with the row's own
    (["specme.segment_length=8"], ["specem"], "'--set prefix'"),
])
def test_cli_bench_set_nothing_would_use_exits_2_before_loading(sets: list[str], methods: list[str], says: str,
                                                                 tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--members", "no-such-model", "--dataset", "arith", "--limit", "1", "--out", str(out)]
    assert main([*argv, *[a for s in sets for a in ("--set", s)], "--methods", *methods]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Unknown member" not in err
    assert not out.exists()  # refused before the results folder is made and any member loads
    # a plain key applies to each requested method that has the field: safe takes lookahead, specem need not
    check_available(BenchOptions(methods=("single", "safe", "specem"), method_config={"*": {"lookahead": 4}}))


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_cli_bench_out_that_cannot_be_written_exits_2_before_loading(kind: str, tmp_path: Path, capsys) -> None:
    taken = tmp_path / "taken"
    taken.write_text("not a folder", encoding="utf-8")
    out = taken if kind == "file" else taken / "results"
    for extra in ([], ["--throughput", "--methods", "single"]):
        assert main(["bench", "--members", "no-such-model", "--dataset", "arith", "--limit", "1", "--out", str(out),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: Cannot write the results to {out}: ") and "Traceback" not in err, err
    assert taken.read_text(encoding="utf-8") == "not a folder"


@pytest.mark.real
def test_cli_bench_limit_2_runs_every_method_on_the_real_pair(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench"
    rc = main(["bench", "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "12", "--out", str(out),
               "--members", "smollm2-135m-instruct", "gemma3-270m", "--microbench-reps", "1", "--no-progress"])
    assert rc == 0
    for name in ARTEFACTS:
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == {}
    assert set(summary["methods"]) == {
        "single[smollm2-135m-instruct]", "single[gemma3-270m]", "every-token[unite]",
        "safe[drafter=smollm2-135m-instruct]", "safe[drafter=gemma3-270m]", "specem", "generate-then-select"}
    for label, row in summary["methods"].items():
        assert row["questions"] == 2 and row["errors"] == 0, label
        assert row["corrupted"] == 0, label
        assert row["mean_latency_s"] > 0 and row["tokens"] > 0, label
    named_qwen = {"trio_safe_small_drafter_vs_biggest"}  # needs a Qwen row: not in the pair
    on_arith = {"trio_ensemble_accuracy"}  # set on arith: reported, not judged, on GSM8K
    judged = [t for t in summary["targets"] if t["id"] not in named_qwen | on_arith]
    assert {t["status"] for t in judged} <= {"met", "missed"}, summary["targets"]
    assert {t["status"] for t in summary["targets"] if t["id"] in named_qwen} == {"not evaluated"}
    assert {t["status"] for t in summary["targets"] if t["id"] in on_arith} == {"reported"}
    assert "| method |" in capsys.readouterr().out


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    """AVX512-BF16 or AMX-BF16 in the flags of /proc/cpuinfo; an AVX2-only CPU has neither."""
    from ensemble_core.models.loading import cpu_has_native_bf16, parse_cpu_flags

    zen4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert cpu_has_native_bf16(parse_cpu_flags(zen4)) and not cpu_has_native_bf16(parse_cpu_flags(avx2))
    assert parse_cpu_flags("no flags here") == frozenset() and not cpu_has_native_bf16(frozenset())
    assert cpu_has_native_bf16(parse_cpu_flags("flags : amx_bf16 amx_tile"))
