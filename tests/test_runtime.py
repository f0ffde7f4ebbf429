"""Shared ensembles and cancellable runs (what both framework adapters build on)."""

from __future__ import annotations

import asyncio

import pytest

from ensemble_core import GenerationCancelled, Member
from ensemble_core.serving.runtime import GenerationTimeout, Run, clear_shared, shared_ensemble


def test_identical_descriptions_share_one_ensemble(tiny_llama: Member, tiny_gemma: Member) -> None:
    clear_shared()
    a = shared_ensemble([tiny_llama, tiny_gemma], "single", {"max_new_tokens": 4})
    assert shared_ensemble([tiny_llama, tiny_gemma], "single", {"max_new_tokens": 4}) is a
    assert shared_ensemble([tiny_llama, tiny_gemma], "single", {"max_new_tokens": 5}) is not a
    assert shared_ensemble([tiny_gemma, tiny_llama], "single", {"max_new_tokens": 4}) is not a


def test_member_specs_are_keyed_by_their_fields(tiny_llama: Member, tmp_path) -> None:
    """A MemberSpec with a dict ``device_map`` made the cache key unhashable (a raw TypeError)."""
    from ensemble_core import MemberSpec
    from ensemble_core.serving.runtime import member_key

    tiny_llama.model.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    mapped = [MemberSpec(str(tmp_path), device_map={"": "cpu"}) for _ in range(2)]
    assert hash(member_key(mapped[0])) == hash(member_key(mapped[1])) and member_key(mapped[0]) == member_key(mapped[1])
    assert member_key(MemberSpec(str(tmp_path))) != member_key(mapped[0])
    clear_shared()
    assert shared_ensemble([mapped[0]], "single") is shared_ensemble([mapped[1]], "single")


def test_run_streams_and_validates_early(tiny_llama: Member) -> None:
    ens = shared_ensemble([tiny_llama], "single")
    run = Run(ens, "hello", {"max_new_tokens": 6})
    text = "".join(run)
    assert run.result is not None and run.result.text == text
    with pytest.raises(Exception, match="max_new_tokens"):
        Run(ens, "hello", {"max_new_tokens": 0})


def test_cancel_before_start_and_timeout(tiny_llama: Member) -> None:
    ens = shared_ensemble([tiny_llama], "single")
    with ens.lock:  # another request holds the ensemble
        run = Run(ens, "hello", {"max_new_tokens": 6})
        run.cancel()
        with pytest.raises(GenerationCancelled, match="waiting"):
            run.run()
    with pytest.raises(GenerationTimeout):
        Run(ens, "hello", {"max_new_tokens": 4000}, timeout=0.05).run()


def test_async_stream_keeps_the_loop_free_and_cancels(tiny_llama: Member) -> None:
    ens = shared_ensemble([tiny_llama], "single")

    async def main() -> tuple[int, Run]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        run = Run(ens, "hello", {"max_new_tokens": 4000})
        n = 0
        async for _ in run.astream():
            n += 1
            if n == 3:
                break  # closing the iterator cancels the run
        t.cancel()
        return ticks, run

    ticks, run = asyncio.run(main())
    assert ticks > 0 and run.cancelled
