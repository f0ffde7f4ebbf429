"""The batch KV storage that stays put between passes (:mod:`ensemble_core.decoding.slab`).

Every check compares a row decoded in batched passes through a slab with the same row
decoded alone, on random-weight members with the real tokenizers, and counts how often
the slab was used where it lay, rebuilt or bypassed (never timed).
"""

from __future__ import annotations

import pytest
import torch

from ensemble_core.decoding.forward import batched_forward
from ensemble_core.decoding.members import DecodeState
from ensemble_core.decoding.slab import Slab, room_for
from ensemble_core.testing import feed_jobs, random_ids, tiny_member


def pairs(member, lengths: list[int]) -> tuple[list[DecodeState], list[DecodeState]]:
    """Two identical states per prompt length: one for the batched passes, one decoded alone."""
    batched, alone = [], []
    for r, n in enumerate(lengths):
        a, b = (member.start_from_ids(random_ids(n, r)) for _ in range(2))
        for s in (a, b):
            s.score(random_ids(3, 100 + r))
        batched.append(a)
        alone.append(b)
    return batched, alone


def batched_step(member, states: list[DecodeState], feeds: list[list[int]], slab: Slab) -> list[torch.Tensor]:
    with torch.inference_mode():
        got = batched_forward(member.model, feed_jobs(states, feeds), {}, slab)
    assert got is not None
    return got


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5), float((g - w).abs().max())


def assert_same_caches(batched: list[DecodeState], alone: list[DecodeState]) -> None:
    for a, b in zip(batched, alone):
        for la, lb in zip(a.cache.layers, b.cache.layers):
            assert la.keys.shape == lb.keys.shape
            assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)


@pytest.mark.parametrize(("alias", "window", "counts"), [
    ("smollm2-135m-instruct", None, (1, 3)),
    ("gemma3-270m", None, (1, 3)),  # window 512: the sliding layers hold every row's whole history
    ("gemma3-270m", 16, (2, 2)),  # the crop past the window slices row 1's sliding layers: rebuilt without them
])
def test_rows_stay_in_the_slab_across_passes_crops_and_lone_steps(alias: str, window: int | None,
                                                                   counts: tuple[int, int]) -> None:
    """Passes over the same rows read the slab where it lies (one rebuild, then in place), also
    after a row was cropped (a rejected draft) or fed alone in between. Gemma-3's sliding layers
    live in the slab while they hold whole histories; with a 16-token window the crop drops
    states from the front and those layers are gathered again next to the slab's full ones."""
    extra = {"sliding_window": window} if window else {}
    member = tiny_member(alias, seed=3, layers=6, **extra)
    batched, alone = pairs(member, [5, 30, 12, 1])
    slab = Slab()
    for step in range(4):
        feeds = [random_ids(k, 50 + k + step) for k in (1, 3, 1, 4)]
        want = [s.score(f)[1:] for s, f in zip(alone, feeds)]
        assert_same(batched_step(member, batched, feeds, slab), want)
        if step == 1:  # a rejected draft: both copies drop their last two ids
            for s in (batched[1], alone[1]):
                s.crop(len(s.ids) - 2)
        if step == 2:  # a row decoded alone between two batched passes appends into its slot
            extra_ids = random_ids(2, 77)
            assert_same([batched[2].score(extra_ids)[1:]], [alone[2].score(extra_ids)[1:]])  # row 0: last pass
    assert (slab.stats.rebuilt, slab.stats.in_place) == counts
    kinds = member.model.config.layer_types if alias.startswith("gemma") else ["full_attention"] * 6
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert sorted(slab.keys) == (full if window else list(range(6)))
    assert_same_caches(batched, alone)


def test_a_row_joining_or_leaving_and_a_full_slab_rebuild_it_only_when_needed() -> None:
    member = tiny_member("smollm2-135m-instruct", seed=1, layers=4)
    batched, alone = pairs(member, [4, 9, 6])
    slab = Slab()

    def step(rows: list[int], k: int, seed: int) -> None:
        feeds = [random_ids(k, seed + r) for r in rows]
        want = [alone[r].score(f)[-k:] for r, f in zip(rows, feeds)]
        assert_same(batch := batched_step(member, [batched[r] for r in rows], feeds, slab), want)
        assert len(batch) == len(rows)

    step([0, 1], 1, 10)
    assert (slab.stats.rebuilt, slab.stats.in_place) == (1, 0)
    step([2, 0, 1], 1, 20)  # a row joins: copied in with the others, in slot order
    assert slab.stats.rebuilt == 2
    step([1, 2, 0], 1, 30)  # any job order: rows are sorted by slot, results come back in job order
    assert slab.stats.in_place == 1
    step([0, 2], 1, 40)  # the live row in between sits out: gathered, nothing moved
    assert (slab.stats.rebuilt, slab.stats.gathered) == (2, 1)
    step([0, 1, 2], 1, 50)  # ... and its slot was not disturbed
    assert slab.stats.in_place == 2
    del batched[1], alone[1]  # a finished request: its slot is a hole that only finished rows leave
    step([0, 1], 1, 60)
    assert slab.stats.rebuilt == 3
    grow = slab.capacity - max(len(s.ids) for s in batched) + 1
    step([0, 1], grow, 70)  # more than the slab's room: rebuilt larger
    assert slab.stats.rebuilt == 4 and slab.capacity >= room_for(max(len(s.ids) for s in batched))
    assert_same_caches(batched, alone)


def test_a_slab_row_survives_what_the_rows_own_cache_does_and_padding_never_reads_scratch() -> None:
    """Fresh slab memory is zeros and scratch columns are old finite states: a row far shorter
    than the others and fed one token next to a 4-token row reads no NaN."""
    member = tiny_member("smollm2-135m-instruct", seed=2, layers=3)
    batched, alone = pairs(member, [1, 40])
    slab = Slab()
    for step in range(3):
        feeds = [random_ids(1, 5 + step), random_ids(4, 9 + step)]
        want = [alone[0].score(feeds[0])[-1:], alone[1].score(feeds[1])[-4:]]
        got = batched_step(member, batched, feeds, slab)
        assert all(torch.isfinite(g).all() for g in got)
        assert_same(got, want)
    first = batched[0].cache.layers[0]
    assert first._k.data_ptr() == slab.keys[0][0].data_ptr()  # the row's own buffer is its slot
