"""Batched decoding across concurrent requests (:mod:`ensemble_core.decoding.scheduler`).

Batched outputs must equal unbatched ones: a batched pass is exact in arithmetic (padding
is masked out, positions are explicit), only the floating-point summation order of a
batch differs from a one-row pass (~1e-7 on logits, measured in
``test_a_batched_pass_matches_the_rows_run_alone``), so greedy choices do not flip here.
Forward passes are counted, never timed.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ensemble_core import Ensemble, Member
from ensemble_core.decoding import forward
from ensemble_core.decoding.forward import Job, batched_forward, plan_groups
from ensemble_core.decoding.scheduler import Batcher, BatchingConfig, batching_config
from ensemble_core.errors import InputError, InvalidOptionError
from ensemble_core.testing import feed_jobs, random_ids, tiny_member

PROMPTS = [
    "Hi",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
    "Name three colours, separated by commas, and nothing else please.",
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "A longer prompt: " + "the quick brown fox jumps over the lazy dog; " * 6,
    "Translate 'bonjour' into English.",
    "Count: one, two, three,",
]
METHODS = ["single", "safe", "specem", "every-token", "generate-then-select"]


@pytest.fixture(scope="module")
def llama() -> Member:
    """Random weights drawn wide enough that greedy decoding writes varied words (the default
    initialisation repeats one whitespace token, which would make every comparison vacuous)."""
    return tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def gemma() -> Member:
    return tiny_member("gemma3-270m", seed=0, initializer_range=0.2)


def members_for(method: str, llama: Member, gemma: Member) -> list[Member]:
    return [llama] if method == "single" else [llama, gemma]


def total_rows_fed(results: list) -> int:
    return sum(m["forward_passes"] for r in results for m in r.stats["members"])


@pytest.mark.parametrize("method", METHODS)
def test_batched_greedy_outputs_equal_unbatched(method: str, llama: Member, gemma: Member) -> None:
    members = members_for(method, llama, gemma)
    # the published settings: drafts of lookahead tokens and uniform votes, whose texts and passes the
    # batched rows were measured on (SAFE with the CPU's draft_confidence drafts one token at a time
    # from these random members)
    options = {"max_new_tokens": 10, **({} if method == "single" else {"published": True})}
    alone = Ensemble(members, method=method, batching=False, **options)
    together = Ensemble(members, method=method, **options)
    expected = alone.batch(PROMPTS)
    got = together.batch(PROMPTS)
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert sum(bool(r.text) for r in expected) >= 6  # the comparison is not vacuous
    stats = together.method.batcher.stats
    assert stats.batched_calls > 0 and stats.max_rows > 1
    assert stats.model_calls < total_rows_fed(got)
    # rows' caches went through the batch storage (how many stayed in place depends on which rows share each
    # pass, i.e. on the threads' timing: every-token kept 3 in place alone, 2 under load, once 0; the exact
    # counts of given row sets are test_slab.py's)
    assert stats.slab_in_place + stats.slab_rebuilt > 0
    batcher = together.method.batcher
    assert len(batcher._slabs) == 0 and len(batcher._buffers) == 0  # the last request to leave freed them


def run_threads(targets: list) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)


def test_concurrent_single_requests_share_forward_passes(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=16)
    prompts = PROMPTS[:8]
    results = ens.batch(prompts)
    rows = total_rows_fed(results)  # passes each request took part in (prefill + one per token)
    calls = ens.method.batcher.stats.model_calls
    assert rows >= 8 * 10
    assert calls * 3 <= rows, (calls, rows)  # 8 requests in lock step: about one call per token for all of them


@pytest.mark.parametrize("rows", [None, 2])
def test_a_failing_prompt_cancels_the_rest_of_its_batch(rows: int | None, llama: Member) -> None:
    """An empty prompt among long answers raised only after all of them had been decoded (and thrown
    away); now the others stop after their round and those not yet started never start (passes counted:
    the two answers alone take ~2 x 200). With ``max_batch_rows=2`` the empty prompt waits for a worker
    beside one running answer; the answers after it never start."""
    batching = {"max_batch_rows": rows} if rows else True
    ens = Ensemble([llama], method="single", max_new_tokens=200, batching=batching)
    with pytest.raises(InputError, match="empty"):
        ens.batch([PROMPTS[1], "", PROMPTS[2], PROMPTS[3]])
    stats = ens.method.batcher.stats
    assert stats.rows < 60 and ens.method.batcher.requests == 0, stats
    after = ens.batch(PROMPTS[1:4])  # still serves; and the answers cut short above are long ones
    assert [r.finish_reason for r in after] == ["length"] * 3


@pytest.mark.parametrize("method", ["safe", "specem"])
def test_prompt_lookup_guesses_only_while_few_requests_decode(method: str, llama: Member, gemma: Member,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Guessed tokens are compute in a batched pass (8 SAFE requests lost throughput with them),
    so by default (``prompt_lookup_max_requests=1``) a drafter guesses only while its request
    decodes alone; None guesses at any load. The texts are the unbatched ones either way."""
    prompts = [f"Repeat: {w} {w} {w} {w} {w} {w} {w} {w} {w} {w}." for w in ("la", "do", "mi", "so")]
    # the published settings but for the lookup (uniform votes, drafts of lookahead tokens): the recorded
    # guess counts are of the published fusion, and a random drafter's drafts would end after every token
    options = {"max_new_tokens": 16, "prompt_lookup": 4, "published": True}
    alone = Ensemble([llama, gemma], method=method, batching=False, **options)
    expected = [alone.generate(p).text for p in prompts]
    # the rule is checked where it is applied (how many requests decode together when a drafter asks
    # depends on when each thread starts: the passes saved by guessing were once 175 vs 176, one pass apart)
    from ensemble_core.decoding import lookup
    from ensemble_core.decoding.scheduler import concurrent_requests

    asked: list[tuple[int, int]] = []  # (requests decoding together, guesses allowed) per drafter pass

    def counted(prompt_lookup: int, max_requests: int | None) -> int:
        allowed = lookup.guesses_now(prompt_lookup, max_requests)
        asked.append((concurrent_requests(), allowed))
        return allowed

    monkeypatch.setattr(f"ensemble_core.methods.{method}.guesses_now", counted)
    passes = {}
    for limit in (1, None):
        asked.clear()
        together = Ensemble([llama, gemma], method=method, prompt_lookup_max_requests=limit, **options)
        results = together.batch(prompts)
        assert [r.text for r in results] == expected
        passes[limit] = total_rows_fed(results)
        if limit == 1:  # no guesses while others decode, guesses while alone (the last request's tail)
            assert all(n <= 1 for n, allowed in asked if allowed) and any(n > 1 for n, _ in asked), asked
        else:  # guesses at any load
            assert all(allowed == 4 for _, allowed in asked) and any(n > 1 for n, _ in asked), asked
    assert passes[None] <= passes[1]  # guessing never costs passes


def test_guesses_now_counts_the_requests_decoding_together() -> None:
    from ensemble_core.decoding.lookup import guesses_now
    from ensemble_core.decoding.scheduler import Binding, bound, concurrent_requests
    from ensemble_core.options import PromptLookupOptions

    assert concurrent_requests() == 1 and guesses_now(4, 1) == 4  # unbatched: alone
    batcher = Batcher()
    first = batcher.join()
    with bound(Binding(batcher, first)):
        assert concurrent_requests() == 1 and guesses_now(4, 1) == 4
        second = batcher.join()
        assert concurrent_requests() == 2 and guesses_now(4, 1) == 0 and guesses_now(4, 2) == 4
        assert guesses_now(4, None) == 4 and guesses_now(0, 1) == 0
        batcher.pause(second)  # a stream waiting for its consumer does not decode
        assert guesses_now(4, 1) == 4
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidOptionError, match="prompt_lookup_max_requests"):
            PromptLookupOptions(prompt_lookup_max_requests=bad)


def test_rows_finish_early_stop_per_row_and_are_unaffected(llama: Member, gemma: Member) -> None:
    calls = [(PROMPTS[i], {"max_new_tokens": n}) for i, n in enumerate([2, 5, 9, 14])]
    calls += [(PROMPTS[4], {"max_new_tokens": 14, "stop": ["e"]}), (PROMPTS[5], {"max_new_tokens": 14, "stop": ["a", "o"]})]
    for method in ("single", "safe"):
        members = members_for(method, llama, gemma)
        alone = Ensemble(members, method=method, batching=False)
        together = Ensemble(members, method=method)
        expected = [alone.generate(p, **o) for p, o in calls]
        got: dict[int, object] = {}
        run_threads([lambda i=i, p=p, o=o, ens=together, out=got: out.__setitem__(i, ens.generate(p, **o))
                     for i, (p, o) in enumerate(calls)])
        assert [got[i].text for i in range(len(calls))] == [r.text for r in expected]
        assert "stop" in [r.finish_reason for r in expected] and len({len(r.text) for r in expected}) > 3
        assert [got[i].finish_reason for i in range(len(calls))] == [r.finish_reason for r in expected]
        assert together.method.batcher.stats.batched_calls > 0


def test_a_cancelled_row_leaves_the_others_unaffected(llama: Member) -> None:
    alone = Ensemble([llama], method="single", batching=False, max_new_tokens=14)
    together = Ensemble([llama], method="single", max_new_tokens=14)
    expected = [alone.generate(p).text for p in PROMPTS[:4]]
    cancel = threading.Event()
    out: dict[int, object] = {}

    def consume(i: int) -> None:
        stream = together.stream(PROMPTS[i], cancel=cancel if i == 0 else None)
        for k, _ in enumerate(stream):
            if i == 0 and k == 1:
                cancel.set()
        out[i] = stream.result

    run_threads([lambda i=i: consume(i) for i in range(4)])
    assert out[0].finish_reason == "cancelled" and len(out[0].text) < len(expected[0])
    assert [out[i].text for i in (1, 2, 3)] == expected[1:]


def test_a_row_joining_mid_flight_is_batched_and_exact(llama: Member) -> None:
    alone = Ensemble([llama], method="single", batching=False, max_new_tokens=14)
    together = Ensemble([llama], method="single", max_new_tokens=14)
    expected = [alone.generate(p).text for p in PROMPTS[1:3]]
    started = threading.Event()
    out: dict[int, str] = {}

    def first() -> None:
        stream = together.stream(PROMPTS[1])
        for k, _ in enumerate(stream):
            if k == 2:
                started.set()
                # while its reader holds a chunk the stream is paused (not counted as decoding): wait here
                # until the late request decodes, so that the rest of this answer overlaps it however the
                # threads are scheduled (it once finished before the late one's prefill)
                deadline = time.monotonic() + 60
                while together.method.batcher.requests < 1 and time.monotonic() < deadline:
                    time.sleep(0.005)
        started.set()
        out[0] = stream.result.text

    def late() -> None:
        assert started.wait(60)
        out[1] = together.generate(PROMPTS[2]).text

    run_threads([first, late])
    assert [out[0], out[1]] == expected
    assert together.method.batcher.stats.batched_calls > 0


def test_runs_from_several_threads_run_concurrently_without_the_lock(llama: Member) -> None:
    from ensemble_core.serving.runtime import Run

    ens = Ensemble([llama], method="single", max_new_tokens=10)
    reference = [Ensemble([llama], method="single", batching=False, max_new_tokens=10).generate(p).text
                 for p in PROMPTS[:4]]
    out: dict[int, str] = {}
    with ens.lock:  # batched runs never take the per-round lock
        run_threads([lambda i=i: out.__setitem__(i, Run(ens, PROMPTS[i]).run().text) for i in range(4)])
    assert [out[i] for i in range(4)] == reference
    assert ens.method.batcher.stats.batched_calls > 0


SCHEMA = {"type": "object", "properties": {"city_name": {"type": "string", "maxLength": 8},
                                           "forecast_days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city_name", "forecast_days"], "additionalProperties": False}


@pytest.mark.parametrize("method", ["single", "safe"])
def test_constrained_requests_batched_equal_alone(llama: Member, gemma: Member, method: str) -> None:
    """Requests under grammars decoding together (a schema each; the tokens the grammar forces ride along
    with a pass, so the batched jobs differ in length, #38) write what each writes alone."""
    members = [llama] if method == "single" else [llama, gemma]
    options = {"max_new_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    reference = [Ensemble(members, method=method, batching=False, **options).generate(p).text for p in PROMPTS[:4]]
    ens = Ensemble(members, method=method, **options)
    out: dict[int, str] = {}
    run_threads([lambda i=i: out.__setitem__(i, ens.generate(PROMPTS[i]).text) for i in range(4)])
    assert [out[i] for i in range(4)] == reference
    assert all(text.startswith("{") for text in reference), reference
    assert ens.method.batcher.stats.batched_calls > 0


def test_seeded_sampling_stays_reproducible_per_request(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=10, do_sample=True, temperature=2.0)
    alone = Ensemble([llama], method="single", batching=False, max_new_tokens=10, do_sample=True, temperature=2.0)
    seeds = [1, 2, 3, 4]
    expected = [alone.generate(PROMPTS[1], seed=s).text for s in seeds]
    out: dict[int, str] = {}
    run_threads([lambda s=s: out.__setitem__(s, ens.generate(PROMPTS[1], seed=s).text) for s in seeds])
    assert [out[s] for s in seeds] == expected


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_batched_pass_matches_the_rows_run_alone(alias: str) -> None:
    """Rows of different cache lengths, fed 1-4 tokens; Gemma-3 with a 16-token window so that
    caches are past the window (its sliding layers expose only the last 15 states)."""
    extra = {"sliding_window": 16} if alias.startswith("gemma") else {}
    member = tiny_member(alias, seed=3, layers=6, **extra)
    batched, alone = [], []
    for r, n in enumerate([5, 30, 12, 1]):
        pair = [member.start_from_ids(random_ids(n, r)) for _ in range(2)]
        for s in pair:
            s.score(random_ids(r * 7, 100 + r))
        batched.append(pair[0])
        alone.append(pair[1])
    buffers: dict = {}  # as a Batcher keeps them: the second pass gathers into the first pass's buffers
    for step in range(3):
        feeds = [random_ids(k, 50 + k + step) for k in (1, 3, 1, 4)]
        want = [s.score(f)[1:] for s, f in zip(alone, feeds)]
        jobs = feed_jobs(batched, feeds)
        with torch.inference_mode():
            got = batched_forward(member.model, jobs, buffers if step else None)
        assert got is not None
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5), float((g - w).abs().max())
        if step == 1:
            storage = {key: buf.data_ptr() for key, buf in buffers.items()}
            assert storage and len(storage) == 2 * len(member.model.model.layers)
    assert {key: buf.data_ptr() for key, buf in buffers.items()} == storage
    for a, b in zip(batched, alone):  # the caches were scattered back exactly
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert torch.allclose(la.keys, lb.keys, atol=1e-5) and la.keys.shape == lb.keys.shape


def test_plan_groups_keeps_a_long_prefill_apart() -> None:
    assert plan_groups([1, 1, 1, 300, 1], 2.0) == [[0, 1, 2, 4], [3]]
    assert plan_groups([1, 3, 5, 2], 2.0) == [[0, 3, 1, 2]]
    assert plan_groups([], 2.0) == []


def test_plan_groups_splits_prefills_whose_padding_would_cost_more_than_a_pass() -> None:
    prompts = [90, 99, 108, 120, 121, 129, 135, 174]  # eight GSM8K prompts' token counts
    assert plan_groups(prompts, 2.0) == [list(range(8))]  # the ratio alone pads 416 tokens
    assert plan_groups(prompts, 2.0, 64) == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert plan_groups([1] * 8 + [17, 18, 19, 19], 2.0, 64) == [list(range(8)), [8, 9, 10, 11]]
    assert plan_groups([1, 17, 18, 19], 2.0, 64) == [[0, 1, 2, 3]]  # 18 padding tokens beat a second pass


def test_the_straggler_wait_counts_from_the_end_of_the_last_pass() -> None:
    """A call queued while a pass ran is old when the pass ends; the requests that were in that
    pass must still get ``max_wait_ms`` to queue their next call, or the batch splits into small passes."""
    batcher = Batcher(BatchingConfig(max_wait_ms=10_000))
    batcher.join()  # a request busy in Python: not waiting
    waiting = batcher.join()
    long_ago = time.perf_counter() - 60.0
    job = Job(None, [1], torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), [0],
              lambda: torch.zeros(1, 2), participant=waiting, queued_at=long_ago)
    waiting.waiting = 1
    batcher._queues[0] = (object(), [job])
    batcher._last_pass = time.perf_counter()  # a pass just ended
    assert batcher._ready(10.0) == []
    batcher._last_pass = time.perf_counter() - 15.0  # max_wait has passed, but others still queue:
    batcher._last_submit = time.perf_counter()  # wait on, up to PATIENCE * max_wait
    assert batcher._ready(10.0) == []
    batcher._last_pass = long_ago  # ... but a straggler is not waited for forever
    assert batcher._ready(10.0) == [(batcher._queues[0][0], [job])]


def test_a_pass_waits_for_every_member_thread_of_a_request() -> None:
    """A request running its members in threads holds up a pass until each of them has queued
    (or finished): one queued job of the request is not enough (fails on the rule that counted
    requests: its members' draft steps then alternated between half-empty passes)."""
    batcher = Batcher(BatchingConfig(max_wait_ms=10_000))
    request = batcher.join()
    batcher._last_pass = time.perf_counter()

    def queue() -> Job:
        job = Job(None, [1], torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), [0],
                  lambda: torch.zeros(1, 2), participant=request, queued_at=time.perf_counter())
        request.waiting += 1
        batcher._queues.setdefault(len(batcher._queues), (object(), []))[1].append(job)
        return job

    with batcher.threads(request, 2) as done:
        assert request.active == 2
        queue()  # one member thread queued, the other still computes
        assert batcher._ready(10.0) == []
        queue()
        assert len(batcher._ready(10.0)) == 2  # both members' rows run in this flush
        request.waiting = 0
        done()
        assert request.active == 1  # the other thread still works
        done()
        assert request.active == 1  # the last one hands the turn back to the request's thread
    assert request.active == 1
    with batcher.threads(request, 3):  # threads that never report done are accounted at the end
        assert request.active == 3
    assert request.active == 1


def test_generate_keeps_its_request_active_between_deltas(llama: Member) -> None:
    """``generate`` takes every delta at once, so its request is never paused: a pass is not
    started without it while it is about to queue (a stream with its own consumer is paused)."""
    ens = Ensemble([llama], method="single", max_new_tokens=8)
    batcher = ens.method.batcher
    pauses = []
    original = batcher.pause
    batcher.pause = lambda p: (pauses.append(p), original(p))[1]  # a counting wrapper, the real pause runs
    ens.generate(PROMPTS[1])
    paused_by_generate = len(pauses)
    deltas = list(ens.stream(PROMPTS[1]))
    assert paused_by_generate == 1  # only ``leave`` at the end
    assert len(pauses) - paused_by_generate == len(deltas) + 1
    # the async paths (the server, the adapters' ainvoke/astream) produce deltas in a worker thread that
    # queues them and goes on: they are never paused either
    from ensemble_core.serving.runtime import Run

    async def consume() -> tuple[str, str]:
        streamed = "".join([d async for d in Run(ens, PROMPTS[1]).astream()])
        return streamed, (await Run(ens, PROMPTS[1]).arun()).text

    before = len(pauses)
    streamed, whole = asyncio.run(consume())
    assert streamed == whole == "".join(deltas) and len(pauses) - before == 2  # one ``leave`` each


def test_rows_left_queued_do_not_poll_while_a_pass_runs() -> None:
    """Rows over ``max_batch_rows`` wait for the running pass to end (it notifies them) instead of
    waking every 0.1 ms once their deadline has passed, next to the pass, on the same cores."""
    batcher = Batcher(BatchingConfig(max_batch_rows=1, max_wait_ms=0))
    first, second = batcher.join(), batcher.join()
    entered, release = threading.Event(), threading.Event()

    def job(block: bool) -> Job:
        def direct() -> torch.Tensor:
            if block:
                entered.set()
                release.wait(30)
            return torch.zeros(1, 2)
        return Job(None, [1], torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), [0], direct)

    class Member:
        name, model = "m", object()

    results: list[torch.Tensor] = []
    a = threading.Thread(target=lambda: results.append(batcher.submit(Member, first, job(True))))
    a.start()
    assert entered.wait(30)  # the first row's pass is running
    deadlines = []
    original = batcher._deadline
    batcher._deadline = lambda wait: (deadlines.append(wait), original(wait))[1]  # counting, the real rule runs
    b = threading.Thread(target=lambda: results.append(batcher.submit(Member, second, job(False))))
    b.start()
    time.sleep(0.2)  # time to poll, if it did
    polled = len(deadlines)
    release.set()
    a.join(30)
    b.join(30)
    assert len(results) == 2 and polled == 0


@pytest.mark.parametrize("field,value", [("max_batch_rows", 0), ("max_batch_rows", True), ("max_wait_ms", -1),
                                         ("max_pad_ratio", 0.5), ("enabled", "yes"),
                                         ("max_pad_tokens", -1), ("max_pad_tokens", 2.5)])
def test_bad_batching_options_raise_typed_errors(field: str, value: object) -> None:
    with pytest.raises(InvalidOptionError, match=field):
        BatchingConfig(**{field: value})
    with pytest.raises(InvalidOptionError, match="batching"):
        batching_config("on")
    assert batching_config(False).enabled is False and batching_config({"max_batch_rows": 2}).max_batch_rows == 2


def test_max_batch_rows_queues_the_rest(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=6, batching={"max_batch_rows": 2})
    reference = Ensemble([llama], method="single", batching=False, max_new_tokens=6).batch(PROMPTS[:5])
    assert [r.text for r in ens.batch(PROMPTS[:5])] == [r.text for r in reference]
    assert ens.method.batcher.stats.max_rows == 2


def test_a_lone_request_is_never_padded(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=6)
    ens.generate(PROMPTS[2])
    stats = ens.method.batcher.stats
    assert stats.batched_calls == 0 and stats.model_calls == stats.rows > 0
    assert isinstance(ens.method.batcher, Batcher) and time.perf_counter() > 0


def test_a_lone_request_runs_its_member_threads_without_the_batcher(llama: Member, gemma: Member) -> None:
    """Alone, SpecEM's member threads overlap their passes as unbatched decoding does: nothing
    is queued or flushed (they used to take turns in the batcher: 0.74x of unbatched)."""
    ens = Ensemble([llama, gemma], method="specem", max_new_tokens=8, parallel=True)
    batcher = ens.method.batcher
    flushes = []
    original = batcher._flush
    batcher._flush = lambda taken: (flushes.append(len(taken)), original(taken))[1]  # counting, the real flush runs
    alone = Ensemble([llama, gemma], method="specem", max_new_tokens=8, parallel=True, batching=False)
    assert ens.generate(PROMPTS[3]).text == alone.generate(PROMPTS[3]).text
    assert flushes == [] and batcher.stats.model_calls > 0 and batcher.stats.batched_calls == 0
    assert sorted(batcher.stats.calls_by_member) == sorted([llama.name, gemma.name])


@pytest.mark.real
def test_real_pair_batched_safe_and_single_equal_unbatched(real_pair: list[Member]) -> None:
    prompts = ["What is 7 times 8?", "Name a fruit.", "Say hello in French.", "What colour is grass?"]
    for method, members in (("single", real_pair[:1]), ("safe", real_pair)):
        alone = Ensemble(members, method=method, batching=False, max_new_tokens=8)
        together = Ensemble(members, method=method, max_new_tokens=8)
        assert [r.text for r in together.batch(prompts)] == [r.text for r in alone.batch(prompts)]
        assert together.method.batcher.stats.batched_calls > 0


def test_throughput_report_and_targets() -> None:
    from ensemble_core.bench.targets import evaluate_targets, load_targets
    from ensemble_core.bench.throughput import evaluate_throughput_targets, markdown

    batcher = {"model_calls": 4, "batched_calls": 4, "rows": 32, "real_tokens": 32, "padded_tokens": 32,
               "per_member": {"m": {"calls": 4, "rows": 32, "rows_per_call": 8.0, "ms_per_call": 90.0}}}
    level = {"requests": 8, "tokens": 64, "seconds": 2.0, "tokens_per_s": 32.0, "sequential_tokens_per_s": 8.0,
             "speedup": 4.0, "mean_latency_s": 2.0, "sequential_mean_latency_s": 1.0, "baseline_requests": 8,
             "identical_outputs": 8, "batcher": batcher, "cpu_steal": {"batched": 0.02, "one_by_one": 0.31}}
    results = {"single": {"members": ["m"], "levels": {"8": level}}}
    targets = evaluate_throughput_targets(results, 8)
    status = {t["id"]: t["status"] for t in targets}
    assert status["batching_single_x8"] == "met" and status["batching_safe_x8"] == "not evaluated"
    table = markdown({"results": results, "targets": targets})
    assert "| single | 8 | 32.00 | 8.00 | 4.00x" in table and "| 2% / 31% |" in table
    assert any("throughput" in t.value for t in load_targets())
    ordinary = evaluate_targets({}, {}, None)  # the per-question bench leaves throughput targets to --throughput
    assert not [t for t in ordinary if t["id"].startswith("batching")]

    # repeats: the level is its median repeat; the table and the target show the spread
    from ensemble_core.bench.throughput import median_repeat

    runs = [dict(level, speedup=v) for v in (2.5, 4.0, 3.5)]
    median = median_repeat(runs)
    assert median["speedup"] == 3.5 and [r["speedup"] for r in median["repeats"]] == [2.5, 4.0, 3.5]
    assert median_repeat(runs[:2])["speedup"] == 2.5  # an even count: the lower middle, a real measurement
    results = {"single": {"members": ["m"], "levels": {"8": median}}}
    target = next(t for t in evaluate_throughput_targets(results, 8) if t["id"] == "batching_single_x8")
    assert target["value"] == 3.5 and "median of 3 repeats (2.50-4.00x), met in 2 of 3" in target["detail"]
    assert "| 3.50x (2.50-4.00, 3 runs) |" in markdown({"results": results, "targets": [target]})


def test_each_throughput_level_brackets_its_own_baseline(llama: Member, monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's speed drifts over minutes, so each level's one-by-one baseline runs half
    just before and half just after its batched run (not once at the start for every level)."""
    from ensemble_core.bench.throughput import ThroughputOptions, measure_method

    events: list[str] = []
    generate, batch = Ensemble.generate, Ensemble.batch
    monkeypatch.setattr(Ensemble, "generate", lambda self, *a, **k: (events.append("alone"), generate(self, *a, **k))[1])
    monkeypatch.setattr(Ensemble, "batch", lambda self, *a, **k: (events.append("batch"), batch(self, *a, **k))[1])
    options = ThroughputOptions(methods=("single",), concurrency=(1, 4), max_new_tokens=4, sequential_requests=2,
                                warmup=False)
    result = measure_method("single", [llama], PROMPTS[:4], options)
    # level 1: its one prompt before the batch; level 4: 2 prompts (the cap), one on each side
    assert events == ["alone", "batch", "alone", "batch", "alone"]
    one, four = result["levels"]["1"], result["levels"]["4"]
    assert (one["baseline_requests"], four["baseline_requests"]) == (1, 2)
    assert (one["identical_outputs"], four["identical_outputs"]) == (1, 2) and four["tokens"] > 0
    assert four["batcher"]["rows"] > 0 and four["speedup"] is not None
    # both sides' share, from /proc/stat; None when no CPU tick elapsed in a span (a batch of 4 tokens can be
    # shorter than a tick: seen once in a full run)
    assert set(four["cpu_steal"]) == {"batched", "one_by_one"}
    assert all(v is None or 0.0 <= v <= 1.0 for v in four["cpu_steal"].values())

    events.clear()  # repeats: each one bracketed by its own baseline
    twice = measure_method("single", [llama], PROMPTS[:4], ThroughputOptions(**{**options.__dict__, "concurrency": (2,),
                                                                                 "repeats": 2}))
    assert events == ["alone", "batch", "alone"] * 2
    level = twice["levels"]["2"]
    assert len(level["repeats"]) == 2 and level["speedup"] == min(r["speedup"] for r in level["repeats"])
    with pytest.raises(InvalidOptionError, match="repeats"):
        ThroughputOptions(repeats=0)


def test_throughput_method_config_reaches_both_sides(llama: Member) -> None:
    """``--set`` overrides (``method_config``) configure the batched ensemble and the one-by-one
    baseline alike (they were dropped under ``--throughput``: the run measured the published
    settings whatever was asked); a typo or a bad value fails before anything loads."""
    from ensemble_core.bench.throughput import ThroughputOptions, markdown, measure_method
    from ensemble_core.errors import ConfigurationError

    options = ThroughputOptions(methods=("single",), concurrency=(2,), max_new_tokens=6, warmup=False,
                                method_config={"single": {"max_new_tokens": 2}})
    level = measure_method("single", [llama], PROMPTS[:2], options)["levels"]["2"]
    # the batched side wrote what a 2-token request writes; the baseline's texts equal them
    short = Ensemble([llama], method="single", max_new_tokens=2, stop=options.stop, batching=False)
    assert level["tokens"] == sum(short.generate(p).completion_tokens for p in PROMPTS[:2])
    assert level["identical_outputs"] == 2
    assert "Method config (both sides): `{\"single\": {\"max_new_tokens\": 2}}`" in markdown(
        {"meta": {"options": {"method_config": options.method_config}}, "results": {}, "targets": []})
    with pytest.raises(ConfigurationError, match="lookahed"):
        ThroughputOptions(methods=("safe",), method_config={"*": {"lookahed": 4}})
    with pytest.raises(InvalidOptionError, match="--set prefix"):
        ThroughputOptions(methods=("safe",), method_config={"safer": {"lookahead": 4}})
    with pytest.raises(ConfigurationError, match="prompt_lookup"):
        ThroughputOptions(methods=("safe",), method_config={"safe": {"prompt_lookup": -1}})


def test_throughput_baseline_runs_in_its_own_process(llama: Member, tmp_path) -> None:
    """``run_throughput`` loads the members by name in a worker process for the one-by-one
    baseline (a shared process charged the batched run for the baseline's leftovers); the
    worker's greedy outputs are the batched ones, and an unloadable member fails by name."""
    import json

    from ensemble_core.bench.throughput import ProcessBaseline, ThroughputOptions, run_throughput
    from ensemble_core.errors import ModelLoadError

    llama.model.save_pretrained(tmp_path / "m")
    llama.tokenizer.save_pretrained(tmp_path / "m")
    options = ThroughputOptions(methods=("single",), members=(str(tmp_path / "m"),), concurrency=(2,),
                                max_new_tokens=4, out=str(tmp_path / "out"), threads=1, warmup=False)
    summary = run_throughput(options)
    level = summary["results"]["single"]["levels"]["2"]
    assert summary["results"]["single"]["baseline"] == "process"
    assert level["baseline_requests"] == 2 and level["identical_outputs"] == 2 and level["tokens"] > 0
    meta = json.loads((tmp_path / "out" / "throughput.json").read_text())["meta"]
    assert meta["options"]["baseline_process"] and meta["options"]["dtype"] == "auto"

    # the members' load options reach both sides (the worker loads its members itself)
    # (a tiny model's prepacked copy fits: both sides prepack, the worker by this process's decision)
    assert summary["results"]["single"]["dtypes"] == summary["results"]["single"]["baseline_dtypes"] == [
        "float32+prepacked"]
    bf16 = ThroughputOptions(**{**options.__dict__, "dtype": ("bfloat16",), "out": str(tmp_path / "bf16")})
    single = run_throughput(bf16)["results"]["single"]
    assert single["dtypes"] == single["baseline_dtypes"] == ["bfloat16"]
    assert len(single["levels"]["2"]["differences"]) == 2 - single["levels"]["2"]["identical_outputs"]
    assert single["levels"]["2"]["identical_outputs"] == 2
    with pytest.raises(ModelLoadError, match="nowhere"):  # raised in the worker, re-raised here
        ProcessBaseline([str(tmp_path / "nowhere")], "single", {"max_new_tokens": 2}, 1, False)


def test_output_differences_say_where_batched_and_alone_outputs_part() -> None:
    from ensemble_core.bench.throughput import _parted, output_differences

    diffs = output_differences(["same", "abcX", "ab"], ["same", "abcd", "abc"])
    assert diffs == [{"request": 1, "common_chars": 3, "chars": 4}, {"request": 2, "common_chars": 2, "chars": 3}]
    assert _parted(diffs) == " (parted at chars 3/4, 2/3)" and _parted([]) == ""


@pytest.mark.parametrize("passes", ["eager", "static"])
def test_a_batched_pass_chooses_its_greedy_rows_tokens_at_once(llama: Member, passes: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """#38: on an accelerator a batched pass takes the argmax of every greedy request's last row at once and
    reads them together (one wait for the device per pass, not one per request and token). Turned on here
    for the CPU: the same texts as each request alone, and the requests' tokens came from the pass."""
    member = Member(llama.model, llama.tokenizer, name=f"llama-{passes}", passes=passes, max_cache_len=256)
    alone = [Ensemble([member], method="single", max_new_tokens=12).generate(p).text for p in PROMPTS[:4]]
    monkeypatch.setattr(forward, "CHOOSE_ON_HOST", True)
    calls: list[int] = []
    real = forward.greedy_choices

    def counted(jobs, results):  # type: ignore[no-untyped-def]
        real(jobs, results)
        calls.append(sum(job.chosen is not None for job in jobs))

    monkeypatch.setattr("ensemble_core.decoding.scheduler.greedy_choices", counted)
    # a pass waits for every request that has joined (not at most 100-400 ms): the four step together
    # once they have started, however busy the machine (a busy core split them into smaller passes)
    ens = Ensemble([member], method="single", max_new_tokens=12, batching={"max_wait_ms": 10_000})
    assert [r.text for r in ens.batch(PROMPTS[:4])] == alone
    assert sum(calls) >= 4 * 8 and max(calls) == 4, calls  # most tokens chosen by the pass, four rows at a time


def test_greedy_choices_are_each_rows_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's choice is ``int(row.argmax())`` per greedy job (the first of equal maxima), None elsewhere."""
    rows = [torch.tensor([[0.0, 1.0, 1.0], [3.0, 2.0, 3.0]]), torch.tensor([[5.0, 0.0, 1.0]]),
            torch.tensor([[0.0, 0.0, 9.0]])]
    jobs = [Job(None, [1], None, None, [0], lambda: None, greedy=g) for g in (True, False, True)]
    forward.greedy_choices(jobs, rows)
    assert [j.chosen for j in jobs] == [None, None, None]  # on the CPU: off by default
    monkeypatch.setattr(forward, "CHOOSE_ON_HOST", True)
    forward.greedy_choices(jobs, rows)
    assert [j.chosen for j in jobs] == [0, None, 2]


@pytest.mark.parametrize("passes", ["eager", "static"])
def test_bursts_of_concurrent_requests_step_together_without_their_threads(llama: Member, passes: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """#38 (vLLM's multi-step scheduling): with ``steps_per_read`` a request's burst is one job of several steps,
    and the scheduler runs the next step of every burst in one pass: the requests' threads submit once per
    burst, not once per token, the steps of four requests share their passes, and each text is its alone text."""
    member = Member(llama.model, llama.tokenizer, name=f"llama-{passes}", passes=passes, max_cache_len=256)
    alone = [Ensemble([member], method="single", max_new_tokens=24, batching=False).generate(p).text for p in PROMPTS[:4]]
    submitted: list[int] = []
    real = Batcher.submit

    def counted(self, model_member, participant, job):  # type: ignore[no-untyped-def]
        submitted.append(job.steps)
        return real(self, model_member, participant, job)

    monkeypatch.setattr(Batcher, "submit", counted)
    ens = Ensemble([member], method="single", max_new_tokens=24, steps_per_read=16,
                   batching={"max_wait_ms": 10_000})  # lock step once started, as above
    results = ens.batch(PROMPTS[:4])
    assert [r.text for r in results] == alone
    tokens = sum(r.stats["tokens"] for r in results)
    assert tokens > 60 and len(submitted) <= 4 * 7, (tokens, submitted)  # prefill, bursts of 1 2 4 8 9 (+ a cut char)
    assert max(submitted) >= 8  # one job for a burst's steps
    stats = ens.method.batcher.stats
    assert stats.max_rows == 4 and stats.batched_calls >= 16, stats.as_dict()  # the bursts' steps, four rows a pass


def test_a_job_of_several_steps_feeds_each_rows_choice_on(llama: Member) -> None:
    """``DecodeState.score_steps``: the rows and ids of a loop that reads each row's argmax (or a seeded draw made
    in the same order) and feeds it, from a state with ids pending and from one with nothing pending (the first
    choice from its cached row); the state holds the fed ids as unread placeholders until settled, and counts
    one pass per step."""
    def drawer():  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(3)
        return lambda row: torch.multinomial(torch.softmax(row, -1), 1, generator=generator)[0]

    for pending in (True, False):
        for sampled in (False, True):
            a, b = (llama.start_from_ids(random_ids(9, 5)) for _ in range(2))
            if not pending:
                a.score(), b.score()
            rows, ids = a.score_steps(5, drawer() if sampled else None)
            choose = drawer() if sampled else (lambda row: row.argmax())
            loop_rows = [b.score()[-1]]
            loop_ids = [int(choose(loop_rows[-1]))]
            for _ in range(4):
                loop_rows.append(b.score([loop_ids[-1]])[-1])
                loop_ids.append(int(choose(loop_rows[-1])))
            assert rows.shape == (5, llama.vocab_size) and ids.tolist() == loop_ids
            assert torch.allclose(rows, torch.stack(loop_rows), atol=1e-5)
            assert a.ids[-4:] == [-1] * 4 and a.cached == len(a.ids) == len(b.ids) == b.cached
            assert a.stats.forward_passes == b.stats.forward_passes
            a.settle(len(a.ids) - 4, loop_ids[:4])
            assert a.ids == b.ids
            assert torch.allclose(a.score([loop_ids[-1]])[-1], b.score([loop_ids[-1]])[-1], atol=1e-5)
    with pytest.raises(InputError, match="steps"):
        a.score_steps(0)


def test_a_failing_draw_fails_its_own_job_of_several_steps_only(llama: Member) -> None:
    """A job's own choice that raises (a sampled draw) ends that job with the error, never with a result that
    passes for fewer steps; the other jobs of the pass run their steps to the end. Alone, the request raises."""
    def bad(row: torch.Tensor) -> torch.Tensor:
        raise ValueError("no draw")

    a, b = (llama.start_from_ids(random_ids(8, 9 + i)) for i in range(2))
    jobs = [a._job(a.ids[a.cached:], 1), b._job(b.ids[b.cached:], 1)]
    for job, state, choose in zip(jobs, (a, b), (bad, None)):
        job.steps, job.follow, job.choose = 4, state.unread_job, choose
    forward.run_steps(jobs, forward._passes_alone)
    assert isinstance(jobs[0].error, ValueError) and jobs[0].step_ids is None
    assert jobs[1].error is None and jobs[1].step_ids is not None and jobs[1].result.shape == (4, llama.vocab_size)
    lone = llama.start_from_ids(random_ids(8, 11))
    with pytest.raises(ValueError, match="no draw"):
        lone.score_steps(4, bad)
