"""Static passes (``passes="static"`` / ``"graphs"``): the same logits and greedy tokens as eager, on fixed buffers.

What a CPU can check of the CUDA-graph path (#38 item 1): every pass a method makes (decode
steps, draft and verify windows, packed verify-in-line candidates, crops, cache branches) runs
on the slot at bucketed shapes and gives eager's logits; the captured function reads nothing
back to the host and never sizes itself by the cache (what a replay would get wrong); slots are
lent and returned; what cannot run static falls back exactly. The capture itself needs a GPU
(tests/gpu_papers.py --passes graphs).
"""

from __future__ import annotations

import argparse
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ensemble_core import Ensemble, InvalidOptionError
from ensemble_core.bench.host_reads import HostReads
from ensemble_core.decoding import static as static_module
from ensemble_core.decoding import verify_inline
from ensemble_core.decoding.forward import Job
from ensemble_core.decoding.masks import allow_row, packed_layout, slot_allowed
from ensemble_core.decoding.members import Member
from ensemble_core.decoding.static import StaticCache, StaticPasses, bucket_for, host_inputs, split_inputs
from ensemble_core.flags import add_load_flags, member_options
from ensemble_core.models.loading import MemberSpec
from ensemble_core.testing import feed_jobs, lockstep, random_ids, tiny_member

ALIASES = {
    "smollm2-135m-instruct": {},
    "qwen2.5-coder-0.5b-instruct": {},
    # a window of 8 makes every context here longer than the window: sliding layers are exercised
    "gemma3-270m": {"layers": 6, "sliding_window": 8},
}


def static_twin(member: Member, mode: str = "static", max_cache_len: int | None = 256) -> Member:
    """The same weights and tokenizer, passes run ``mode``."""
    return Member(member.model, member.tokenizer, name=f"{member.name}-{mode}", passes=mode, max_cache_len=max_cache_len)


def scored_states(member: Member, n: int) -> list:
    """``n`` states of ``member`` on prompts of 6, 7, ... random ids, each scored (nothing pending)."""
    states = [member.start_from_ids(random_ids(6 + i, i)) for i in range(n)]
    for state in states:
        state.score()
    return states


@pytest.mark.parametrize("alias", list(ALIASES))
def test_static_passes_give_eager_logits_and_greedy_tokens(alias: str) -> None:
    eager = tiny_member(alias, seed=1, **ALIASES[alias])
    static = static_twin(eager)
    a, b = eager.start_from_ids(random_ids(20, 3)), static.start_from_ids(random_ids(20, 3))
    assert isinstance(b.cache, StaticCache) and not isinstance(a.cache, StaticCache)
    agreement = lockstep(a, b, 24)
    assert agreement.max_diff < 1e-4 and agreement.same_tokens == agreement.steps
    assert b.stats.static_passes == b.stats.forward_passes > 24  # every pass ran on the slot, none fell back
    assert static.static is not None and static.static.counts["fallbacks"] == 0
    assert b.stats.reprefills == 0  # sliding layers keep every state: crops past the window stay exact
    assert static.static.pool is not None and len(static.static.pool.buckets) >= 4  # steps, feeds, candidates


SCHEMA = {"type": "object", "properties": {"city_name": {"type": "string", "maxLength": 6},
                                           "forecast_days": {"type": "integer"}}, "required": ["city_name", "forecast_days"]}


@pytest.mark.parametrize("method", ["single", "safe", "safe published", "every-token", "specem", "generate-then-select",
                                    "single schema", "safe schema", "safe published sampled", "specem sampled"])
def test_every_method_writes_eager_texts_with_static_members(method: str) -> None:
    llama = tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)
    gemma = tiny_member("gemma3-270m", seed=0, initializer_range=0.2, layers=6, sliding_window=8)
    words = method.split()
    method, published, schema, sampled = words[0], "published" in words, "schema" in words, "sampled" in words
    eager = [llama] if method == "single" else [llama, gemma]
    static = [static_twin(m) for m in eager]
    prompts = ["What is 2 + 2?", "Name three colours.", "A longer prompt: " + "the fox jumps; " * 4]
    # "safe published": the published drafting keeps each draft's ids on the device (drafting.draft_tokens),
    # so the static passes copy them into their inputs there
    options = {"max_new_tokens": 12, **({"published": True} if published else {})}
    if schema:  # a grammar: the tokens it forces ride along with a pass (#38)
        options = {"max_new_tokens": 24, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    if sampled:  # drawn on the device, the drafts' ids kept there unread (#38)
        options.update(do_sample=True, temperature=0.8, seed=4)
    expected = Ensemble(eager, method=method, batching=False, **options).batch(prompts)
    got = Ensemble(static, method=method, **options).batch(prompts)  # batched requests: static rows run per row
    assert [r.text for r in got] == [r.text for r in expected]
    assert sum(bool(r.text) for r in expected) >= 2  # not vacuous
    assert all(m.static is not None and m.static.counts["static"] > 0 for m in static)
    passes = [m for r in got for m in r.stats["members"]]
    assert sum(m["static_passes"] for m in passes) > 0
    assert any(m.static is not None and m.static.counts["batched"] > 0 for m in static)  # groups ran over the pool


def test_requests_beyond_the_pool_decode_eager_next_to_it_with_the_same_texts() -> None:
    """Five concurrent requests, two slots: the scheduler runs the pool's rows and the eager rows as two groups."""
    eager = tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)
    static = static_twin(eager)
    static.static = StaticPasses(static.model, "static", max_cache_len=256, slots=2)
    prompts = ["What is 2 + 2?", "Name three colours.", "Hi", "Count: one, two,", "Why is the sky blue?"]
    expected = Ensemble([eager], method="single", batching=False, max_new_tokens=10).batch(prompts)
    together = Ensemble([static], method="single", max_new_tokens=10)
    got = together.batch(prompts)
    assert [r.text for r in got] == [r.text for r in expected]
    assert static.static.counts["batched"] > 0
    stats = together.method.batcher.stats
    assert stats.batched_calls > static.static.counts["batched"]  # the eager rows were batched too
    # two rows in the pool at a time, the others eager beside them (a request that starts after one in the
    # pool has finished may take its slot: how many ran static depends on when each thread starts)
    assert 2 <= sum(m["static_passes"] > 0 for r in got for m in r.stats["members"]) < len(prompts)


def test_a_batch_gives_its_slots_back_for_the_next_one() -> None:
    """A batch's passes run on the model runner; when the requests end their slots are free again (the
    runner kept the last pass's jobs, and with them their caches, until another call came: every request of
    the next batch found the pool full and decoded eager)."""
    eager = tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)
    static = static_twin(eager)
    static.static = StaticPasses(static.model, "static", max_cache_len=256, slots=4)
    prompts = ["What is 2 + 2?", "Name three colours.", "Hi", "Count: one, two,"]
    together = Ensemble([static], method="single", max_new_tokens=6)
    for _ in range(2):
        got = together.batch(prompts)
        assert [m["static_passes"] > 0 for r in got for m in r.stats["members"]] == [True] * 4
        assert not any(slot.busy for slot in static.static.pool.slots)


def test_a_static_pass_reads_nothing_back_to_the_host() -> None:
    """What a CUDA graph records must not read tensor values on the host (a capture would fail or freeze
    the value) nor size itself by the cache (``WriteCache.get_seq_length`` raises)."""
    member = static_twin(tiny_member("gemma3-270m", seed=1, layers=6, sliding_window=8))
    state = member.start_from_ids(random_ids(12, 5))
    state.score()
    for n in (1, 3, 7):
        state.score(random_ids(n, n))
    runner = member.static
    assert runner is not None and isinstance(state.cache, StaticCache)
    other = member.start_from_ids(random_ids(9, 6))
    other.score()
    jobs = feed_jobs([state, other], [random_ids(2, 1), random_ids(3, 2)])
    assert runner.run_batch(jobs) is not None and runner.pool is not None
    # (rows, tokens, span): one request's passes on slot 0 (its prefill of 12 tokens in bucket 16), the other's
    # prefill on slot 1 (two rows), then both together
    assert sorted(runner.pool.buckets) == [(1, 1, 256), (1, 4, 256), (1, 8, 256), (1, 16, 256), (2, 4, 256),
                                           (2, 16, 256)]
    for bucket in runner.pool.buckets.values():
        with HostReads() as reads:
            runner._forward(runner.pool.keys, runner.pool.values, bucket.span, bucket.inputs, bucket.rows_n,
                            bucket.tokens, bucket.rows)
        assert reads.total == 0, (bucket.key, reads.counts)


def test_passes_read_the_shortest_span_of_the_slot_that_holds_them() -> None:
    eager = tiny_member("gemma3-270m", seed=4, layers=6, sliding_window=8)
    static = static_twin(eager, max_cache_len=1024)
    assert static.static is not None and static.static.spans == (256, 512, 1024)
    a, b = eager.start_from_ids(random_ids(240, 7)), static.start_from_ids(random_ids(240, 7))
    agreement = lockstep(a, b, 8)  # crosses 256 states: spans 256 then 512
    assert agreement.max_diff < 1e-4 and agreement.same_tokens == agreement.steps
    assert isinstance(b.cache, StaticCache)
    assert static.static is not None and static.static.pool is not None
    assert {span for _, _, span in static.static.pool.buckets} == {256, 512}
    assert b.stats.static_passes == b.stats.forward_passes


def test_a_batched_pass_over_the_pool_gives_each_row_its_own_logits() -> None:
    """Rows on slots 0 and 2 run as a 4-row pass (rows 1 and 3 padding); the padding writes into the scratch
    tail, so the state lent slot 3, not in the pass, keeps its states (checked by decoding it afterwards)."""
    eager = tiny_member("gemma3-270m", seed=5, layers=6, sliding_window=8)
    static = static_twin(eager)
    prompts = [random_ids(n, n) for n in (9, 14, 5, 11)]
    a = [eager.start_from_ids(p) for p in prompts]
    b = [static.start_from_ids(p) for p in prompts]
    assert [s.cache.slot.index for s in b if isinstance(s.cache, StaticCache)] == [0, 1, 2, 3]
    for s in a + b:
        s.score()
    del a[1], b[1]
    gc.collect()
    runner = static.static
    assert runner is not None
    for step in range(6):
        feeds = [random_ids(1 + (step + i) % 4, 10 * step + i) for i in range(2)]
        expected = [s.score(f)[1:] for s, f in zip(a[:2], feeds)]
        jobs = feed_jobs(b[:2], feeds)
        got = runner.run_batch(jobs)
        assert got is not None
        for state, rows, want in zip(b[:2], got, expected):
            state._last_row = rows[-1]
            assert float((rows - want).abs().max()) < 1e-4
    assert runner.pool is not None and {r for r, _, _ in runner.pool.buckets} == {1, 2, 4}  # prefills on 0-3; 0 and 2
    agreement = lockstep(a[2], b[2], 3)  # the state on slot 3 sat the passes out as a padding row
    assert agreement.max_diff < 1e-4 and agreement.same_tokens == 3


@pytest.mark.parametrize("window", [None, 3])
def test_slot_masks_from_the_inputs_equal_the_masks_built_row_by_row(window: int | None) -> None:
    """The masks a static pass computes from its flat inputs (``slot_allowed``, inside the graph) equal what
    ``allow_row`` builds per job on the host, for causal and packed jobs, padding queries and padding rows (a
    causal job's positions and window go into the inputs as a range and a triangle, a packed job's as tensors)."""
    torch.manual_seed(0)
    k, span, room = 8, 32, 24
    lengths = [[3], [2, 2, 1], [8], [1]]  # a draft, packed candidates, a full bucket, a decode step
    contexts = [5, 9, 0, 16]
    placed, expected = [], torch.zeros(6, k, span, dtype=torch.bool)
    expected[:, :, 0] = True  # padding rows (4 and 5): column 0 only
    for row, (parts, context) in enumerate(zip(lengths, contexts)):
        positions, block = packed_layout(parts, context, "cpu")
        ids = torch.randint(0, 50, (len(positions),)).tolist()
        job = Job(None, ids, positions, block, [0], lambda: None) if len(parts) > 1 else \
            Job(None, ids, None, None, [0], lambda: None, start=context)  # causal: no layout of its own
        assert all(torch.equal(a, b) for a, b in zip(job.layout(), (positions, block)))
        placed.append((row, job, context))
        expected[row] = False
        allow_row(expected[row], job, 0, 0, context, context, window)
        n = len(positions)  # padding queries of a real row also see the context (harmless: never read)
        expected[row, n:, :context] = torch.arange(context)[None, :] <= positions[-1] + 1 + torch.arange(k - n)[:, None]
        if window is not None:
            q = positions[-1] + 1 + torch.arange(k - n)
            expected[row, n:, :context] &= (q[:, None] - torch.arange(context)[None, :]) < window
    _, positions, _, context, block = split_inputs(host_inputs(placed, 6, k, room), 6, k)
    got = slot_allowed(positions, context, block != 0, span, window)
    assert torch.equal(got, expected)
    assert bool(got.any(-1).all())  # every query sees something: no empty softmax, no NaN into the scratch tail


@pytest.mark.parametrize("k", [1, 4])
def test_the_inputs_of_a_pass_take_the_same_tensor_ops_for_one_row_as_for_sixteen(k: int) -> None:
    """The host builds a pass's inputs in one tensor op whatever its rows (#38: ~33 us per row when it was
    built a row at a time, paid once per step by every request sharing the pass): a causal row's positions
    and window are a range and a triangle in the host's list, also for a window of several tokens."""
    member = tiny_member("qwen2.5-coder-0.5b-instruct", seed=2, layers=1)
    states = scored_states(member, 16)
    counts = []
    for rows in (1, 16):
        jobs = feed_jobs(states[:rows], [random_ids(1, 9)] * rows)
        placed = [(row, job, 6 + row) for row, job in enumerate(jobs)]
        with _Ops() as ops:
            flat = host_inputs(placed, rows, k, 100)
        counts.append(ops.count)
        ids, positions, write, context, block = split_inputs(flat, rows, k)
        assert ids[:, 0].tolist() == [job.ids[0] for job in jobs] and context.tolist() == [6 + r for r in range(rows)]
        assert positions.tolist() == [[6 + r + j for j in range(k)] for r in range(rows)]  # continued past the token
        assert torch.equal(block, torch.eye(k, dtype=torch.long).expand(rows, k, k))  # each query sees itself
    assert counts == [1, 1], counts  # the list made a tensor (412 ops for 16 rows a row at a time, 12 then)
    window = feed_jobs(states[:1], [random_ids(3, 9)])[0]  # three tokens: their causal block, in the list too
    with _Ops() as ops:
        flat = host_inputs([(0, window, 6)], 1, 4, 100)
    _, positions, _, _, block = split_inputs(flat, 1, 4)
    assert ops.count == 1 and positions.tolist() == [[6, 7, 8, 9]]
    assert block[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


def test_a_pool_pass_copies_its_inputs_to_the_device_once_whatever_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host builds a pass's inputs and hands them over in one copy (plus, for several rows, one for the rows
    to keep; a lone row's are a slice), for one row as for four: no per-row device ops before the pass (each is
    a kernel launch on a GPU)."""
    member = static_twin(tiny_member("qwen2.5-coder-0.5b-instruct", seed=2, layers=2))
    states = scored_states(member, 4)
    runner = member.static
    assert runner is not None
    copies: list[str] = []
    real_to_device, real_fill = static_module.to_device, static_module.fill

    def to_device(values, device, dtype=None):  # type: ignore[no-untyped-def]
        copies.append("to_device")
        return real_to_device(values, device, dtype)

    def fill(buffer, values):  # type: ignore[no-untyped-def]
        copies.append("fill")
        real_fill(buffer, values)

    monkeypatch.setattr(static_module, "to_device", to_device)
    monkeypatch.setattr(static_module, "fill", fill)
    for group in (states[:1], states):
        copies.clear()
        assert runner.run_batch(feed_jobs(group, [random_ids(2, 9)] * len(group))) is not None
        assert sorted(copies) == ["fill"] + ["to_device"] * (len(group) > 1), (len(group), copies)


def test_packed_candidates_on_a_static_member_never_build_the_eager_packed_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify-in-line hands its packed layout to the job; the model's own masks (``packed_masks``) are built only
    when the eager call runs: never on a static member, once per packed pass on an eager one. Same scores."""
    eager = tiny_member("gemma3-270m", seed=3, layers=4, sliding_window=8)
    static = static_twin(eager)
    built: list[str] = []
    real = verify_inline.packed_masks

    def counted(state, lengths):  # type: ignore[no-untyped-def]
        built.append(state.member.name)
        return real(state, lengths)

    monkeypatch.setattr(verify_inline, "packed_masks", counted)
    candidates = [random_ids(3, 20), random_ids(2, 21), random_ids(4, 22)]
    scores = {}
    for member in (eager, static):
        state = member.start_from_ids(random_ids(10, 8))
        scores[member.name] = verify_inline.score_candidates_inline(state, candidates)
    assert built == [eager.name]
    for a, b in zip(scores[eager.name], scores[static.name]):
        assert float((a - b).abs().max()) < 1e-4


def test_a_state_that_outgrows_its_slot_leaves_it_and_stays_exact() -> None:
    eager = tiny_member("qwen2.5-coder-0.5b-instruct", seed=2)
    static = static_twin(eager, max_cache_len=96)  # room for 64 states (32 are the scratch tail)
    a, b = eager.start_from_ids(random_ids(20, 1)), static.start_from_ids(random_ids(20, 1))
    for _ in range(60):  # 20 + 60 tokens: past the 64
        ra, rb = a.score(), b.score()
        assert float((ra - rb).abs().max()) < 1e-4
        token = int(ra[-1].argmax())
        a.score([token])
        b.score([token])
    assert static.static is not None and static.static.counts["fallbacks"] > 0
    assert isinstance(b.cache, StaticCache) and not b.cache.in_slot()
    assert 0 < b.stats.static_passes < b.stats.forward_passes


class _Ops(TorchDispatchMode):
    """Counts the tensor ops dispatched in its block (views and slices included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_around_a_pool_pass(layers: int) -> int:
    """Tensor ops a batched pool pass of three requests makes outside the pass itself (what a graph replays)."""
    member = static_twin(tiny_member("qwen2.5-coder-0.5b-instruct", seed=2, layers=layers))
    states = scored_states(member, 3)
    runner = member.static
    assert runner is not None
    inside: list[int] = []
    real = runner._forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = ops.count
        out = real(*args, **kwargs)
        inside.append(ops.count - start)
        return out

    runner._forward = counted  # type: ignore[method-assign]
    with _Ops() as ops:
        assert runner.run_batch(feed_jobs(states, [random_ids(1, 9)] * len(states))) is not None
    assert len(inside) == 1 and [s.cache.get_seq_length() for s in states] == [7, 8, 9]
    assert all(layer.keys.shape[2] == 7 and layer.keys.data_ptr() == layer._k.data_ptr()
               for layer in states[0].cache.layers)  # the states' views as eager code reads them
    return ops.count - inside[0]


def test_the_host_work_around_a_static_pass_does_not_grow_with_the_models_depth() -> None:
    """#38: around the pass, the host checks that each state is in its slot and moves its length, with no
    tensor op per layer (slicing two views per layer and request cost ~5 us per layer on a CPU: ~2 ms per
    batched pass of 16 requests to a 28-layer member, about what a graphed 1B pass of 16 rows computes)."""
    assert _ops_around_a_pool_pass(2) == _ops_around_a_pool_pass(12)
    member = static_twin(tiny_member("qwen2.5-coder-0.5b-instruct", seed=2, layers=12))
    state = member.start_from_ids(random_ids(6, 0))
    state.score()
    with _Ops() as ops:
        assert state.cache.in_slot() and state.cache.get_seq_length() == 6
        state.cache.advance(6)
    assert ops.count == 0


def test_a_lone_greedy_step_makes_few_tensor_ops_outside_its_pass() -> None:
    """#38: around a graph replay, each of a request's tensor ops is host work (a dispatch, maybe a launch) per
    token. A lone greedy ``single`` step makes ten: its inputs (one tensor, one copy), its kept row (a slice
    copied to float32), the row handed back, the argmax and its read. It made 29: a causal job's positions and
    window as tensors (4 ops) placed by index (6 more), a softmax the greedy choice did not need, a gather."""
    member = static_twin(tiny_member("smollm2-135m-instruct", seed=0, layers=2))
    runner = member.static
    assert runner is not None
    real, ops, inside = runner._forward, _Ops(), [0]

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = ops.count
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] += ops.count - start

    runner._forward = counted  # type: ignore[method-assign]
    ensemble = Ensemble([member], method="single", max_new_tokens=12)
    method = ensemble.method
    request = method.begin("Count to twenty.", method.config)
    method.step(request)  # the prefill
    method.step(request)  # the first one-token step makes its bucket's buffers
    steps = 0
    with ops:
        for _ in range(8):
            chunk = method.step(request)
            steps += 1
            if chunk.done:
                break
    assert runner.counts["replays"] == 0 and runner.counts["static"] >= steps + 1  # every step a static pass
    assert (ops.count - inside[0]) / steps <= 10, (ops.count - inside[0], steps)


def test_a_slot_layer_holds_its_prefix_as_a_length_and_anything_else_as_a_tensor() -> None:
    """The layer's ``keys`` / ``values`` read as before (a view of the slot while a prefix of it, else the tensor
    set), so crops, branches and the eager forward see what they saw."""
    member = static_twin(tiny_member("smollm2-135m-instruct", seed=1, layers=2))
    state = member.start_from_ids(random_ids(9, 4))
    state.score()
    layer = state.cache.layers[0]
    assert isinstance(layer, static_module.SlotLayer) and layer.in_slot() and layer.get_seq_length() == 9
    before = layer.keys.clone()
    layer.crop(-4)  # transformers' DynamicLayer.crop: a slice of the view, still the slot's prefix
    assert layer.in_slot() and layer.keys.shape[2] == 5 and torch.equal(layer.keys, before[:, :, :5])
    own = before[:, :, :5].clone()  # a tensor of its own: held, and the layer has left the slot
    layer.keys = own
    assert layer.keys is own and not layer.in_slot() and layer.get_seq_length() == 5
    layer.keys = layer._k[:, :, :5]  # a prefix again
    assert layer.in_slot() and torch.equal(layer.keys, before[:, :, :5])
    layer.crop(-100)  # as slicing ``keys[..., :-100, :]`` does: nothing left, still the slot's prefix
    assert layer.in_slot() and layer.keys.shape[2] == 0 and layer.get_seq_length() == 0
    with pytest.raises(ValueError, match="positive"):  # transformers' own refusal, unchanged
        layer.crop(3)
    other = member.start_from_ids(random_ids(7, 5))
    other.score()
    marks = verify_inline.branch_marks(other)
    with verify_inline.cache_branch(other):  # a branch's passes, then its rewind: by lengths, in the slot
        verify_inline.branch_feed(other, random_ids(3, 6))
        assert other.cache.get_seq_length() == 10
    assert other.cache.get_seq_length() == 7 and other.cache.in_slot()
    assert [m[1] for m in marks] == [7] * len(other.cache.layers)
    layer.reset()
    assert layer.keys is None and layer.values is None and not layer.in_slot()


def test_static_passes_move_one_shared_length_and_layers_moved_otherwise_rejoin_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """#38: while only static passes move a state, its layers read one length (``SlotLength``): a pass checks the
    slot and moves the states without a call per layer. An eager append (the model's own forward), a crop and a
    branch's rewind set the layers' own lengths; the next static pass finds them in the slot at one length and
    shares it again; the logits stay the eager twin's throughout."""
    eager = tiny_member("smollm2-135m-instruct", seed=1, **ALIASES["smollm2-135m-instruct"])
    member = static_twin(eager)
    state, twin = member.start_from_ids(random_ids(9, 4)), eager.start_from_ids(random_ids(9, 4))
    cache = state.cache
    assert isinstance(cache, StaticCache) and cache.length.shared and cache.length.n == 0
    per_layer: list[str] = []
    for name in ("in_slot", "expose"):
        real = getattr(static_module.SlotLayer, name)

        def spy(self, *args, _real=real, _name=name):  # type: ignore[no-untyped-def]
            per_layer.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(static_module.SlotLayer, name, spy)

    def both(ids: list[int]) -> None:
        a, b = state.score(ids), twin.score(ids)
        assert torch.allclose(a, b, atol=1e-4) and cache.get_seq_length() == twin.cache.get_seq_length()

    both([])  # the prefill
    both([11, 12])
    assert per_layer == [] and cache.length.shared and cache.length.n == 11
    assert all(layer.get_seq_length() == 11 and layer.keys.shape[2] == 11 for layer in cache.layers)
    state.crop(9), twin.crop(9)  # one length moved: the layers follow it
    assert per_layer == [] and cache.length.shared and {layer.keys.shape[2] for layer in cache.layers} == {8}
    both([13])
    state.cache.layers[0].crop(-1)  # a layer moved on its own: the others keep the shared length as their own
    assert not cache.length.shared and cache.layers[0].get_seq_length() == 9 and cache.layers[1].get_seq_length() == 10
    assert cache.get_seq_length() == 9 and cache.get_seq_length(1) == 10  # transformers' per-layer answer again
    cache.layers[0].keys = cache.layers[0]._k[:, :, :10]  # back in step: the next pass shares it again
    cache.layers[0].values = cache.layers[0]._v[:, :, :10]
    per_layer.clear()
    both([14])
    assert cache.length.shared and cache.length.n == 11 and per_layer.count("in_slot") == len(cache.layers)
    job = state._job([15], 1)
    state._last_row = job.direct()[-1]  # the model's own forward (a static pass's fallback) appends layer by layer
    state.ids.append(15)
    state.cached = len(state.ids)
    twin.score([15])
    assert not cache.length.shared and cache.in_slot() and cache.length.shared and cache.length.n == 12
    with verify_inline.cache_branch(state):
        verify_inline.branch_feed(state, [16, 17])
    assert cache.get_seq_length() == 12 and cache.in_slot() and cache.length.shared
    both([18])


def test_slots_are_lent_to_one_state_at_a_time_and_returned() -> None:
    member = tiny_member("smollm2-135m-instruct", seed=0)
    member.static = StaticPasses(member.model, "static", max_cache_len=128, slots=1)
    first = member.start_from_ids(random_ids(8, 0))
    second = member.start_from_ids(random_ids(8, 1))
    assert isinstance(first.cache, StaticCache)
    assert not isinstance(second.cache, StaticCache)  # the only slot is lent: eager, exact
    slot = first.cache.slot
    del first  # returned at once (no reference cycle holds a state's cache: no wait for the collector)
    third = member.start_from_ids(random_ids(70, 2))
    assert not isinstance(third.cache, StaticCache)  # a prompt over half a slot stays eager
    fourth = member.start_from_ids(random_ids(8, 3))
    assert isinstance(fourth.cache, StaticCache) and fourth.cache.slot is slot  # returned and lent again


def test_graphs_on_a_cpu_member_run_static_and_say_why() -> None:
    member = static_twin(tiny_member("smollm2-135m-instruct", seed=0), mode="graphs")
    state = member.start_from_ids(random_ids(8, 0))
    state.score([5, 6])
    runner = member.static
    assert runner is not None and "CUDA" in runner.reasons["graphs"] and not runner.capturing
    assert runner.counts["static"] == 1 and runner.counts["captures"] == 0 and state.stats.graph_replays == 0


def test_a_capture_that_fails_costs_its_bucket_the_graph_never_the_request() -> None:
    # a graphed member that tries to capture where capture cannot work (this CPU build has no CUDA: a real
    # failure, not a simulated one) records why per bucket, gives the static pass's logits, and leaves the
    # process-wide capture lock free for the next bucket's attempt (no deadlock, no stuck capture)
    static = static_twin(tiny_member("smollm2-135m-instruct", seed=0))
    graphed = static_twin(tiny_member("smollm2-135m-instruct", seed=0), mode="graphs")
    runner = graphed.static
    assert runner is not None
    runner.reasons.pop("graphs")  # as on a CUDA member: every new bucket tries a capture
    assert runner.capturing
    want, got = static.start_from_ids(random_ids(8, 0)), graphed.start_from_ids(random_ids(8, 0))
    for ids in ([5], [6, 7], [8]):  # buckets 1 and 2 after the prompt's 16, then 1 again (failed: not tried twice)
        assert torch.allclose(want.score(ids), got.score(ids), atol=1e-5)
    failed = {key: why for key, why in runner.reasons.items() if key.startswith("bucket ")}
    assert sorted(failed) == ["bucket 1x16x256", "bucket 1x1x256", "bucket 1x2x256"], runner.reasons
    assert all("cuda" in why.lower() for why in failed.values()), failed
    assert runner.counts["captures"] == runner.counts["replays"] == got.stats.graph_replays == 0
    assert not static_module._CAPTURE_LOCK.locked()


def test_bad_pass_options_raise_typed_errors() -> None:
    member = tiny_member("smollm2-135m-instruct", seed=0)
    with pytest.raises(InvalidOptionError, match="passes"):
        Member(member.model, member.tokenizer, passes="fast")
    with pytest.raises(InvalidOptionError, match="passes"):
        MemberSpec("smollm2-135m-instruct", passes="cuda")
    with pytest.raises(InvalidOptionError, match="max_cache_len"):
        MemberSpec("smollm2-135m-instruct", passes="static", max_cache_len=8)
    with pytest.raises(InvalidOptionError, match="max_cache_len"):
        StaticPasses(member.model, "static", max_cache_len=16)
    with pytest.raises(InvalidOptionError, match=r"max_cache_len.*context window"):  # was a raw allocator error
        Member(member.model, member.tokenizer, passes="static", max_cache_len=10**9)


def test_buckets_pad_to_the_next_size() -> None:
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, None]


@pytest.mark.real
def test_the_bundled_pair_writes_the_same_answer_with_static_passes(real_pair: list[Member]) -> None:
    """The real SmolLM2 + Gemma-3 pair (SAFE, defaults): static members give eager's text, every pass on a slot."""
    question = "Tom has 3 apples and buys 5 more. How many apples does he have?"
    expected = Ensemble(real_pair, max_new_tokens=24).generate(question)
    static = [Member(m.model, m.tokenizer, name=m.name, passes="static", max_cache_len=512) for m in real_pair]
    got = Ensemble(static, max_new_tokens=24).generate(question)
    assert got.text == expected.text and len(got.text) > 10
    members = got.stats["members"]
    assert all(m["static_passes"] == m["forward_passes"] > 0 for m in members), members


def test_the_passes_flag_reaches_every_members_load_options() -> None:
    parser = argparse.ArgumentParser()
    add_load_flags(parser)
    assert [o.get("passes") for o in member_options(parser.parse_args(["--passes", "graphs"]), 2)] == ["graphs"] * 2
    assert all("passes" not in o for o in member_options(parser.parse_args([]), 2))  # eager: the spec's default
    with pytest.raises(SystemExit):
        parser.parse_args(["--passes", "fast"])


def test_the_kept_rows_of_a_pass_are_copies_of_its_logits() -> None:
    """A graph's output is rewritten by the bucket's next replay, so the rows a pass hands back are copies, also
    when the logits are float32 already (``.float()`` would hand back a view) and for a lone job's slice."""
    out = torch.randn(4, 3, 7)
    for placed in ([(2, [1, 2])], [(0, [2]), (3, [0, 1])], [(1, [0, 2])]):
        rows = static_module.kept_rows(out, placed, 3)
        expected = [out[row, keep] for row, keep in placed]
        assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(rows, expected))
        before = [r.clone() for r in rows]
        out.add_(1.0)  # the next replay
        assert all(torch.equal(a, b) for a, b in zip(rows, before))
