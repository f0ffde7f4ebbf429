"""The shared generation loop: stop strings, streaming, cancellation, configs, SingleModel."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from ensemble_core import Ensemble, GenerationConfig, InvalidOptionError, Member
from ensemble_core.bench.host_reads import HostReads
from ensemble_core.decoding.generation import Chunk, EnsembleMethod, _holdback
from ensemble_core.decoding.sampling import device_generator, sample_ids, transformed
from ensemble_core.errors import ConfigurationError, NoMembersError


@dataclass
class _Script:
    chunks: list[str]
    views: list = None  # type: ignore[assignment]
    i: int = 0


class Scripted(EnsembleMethod[GenerationConfig]):
    """Replays fixed committed chunks: isolates the loop's text handling from any model."""

    name = "scripted"

    def __init__(self, members, chunks, **kw):
        super().__init__(members, **kw)
        self.chunks = chunks

    def begin(self, prompt, config):
        return _Script(list(self.chunks))

    def step(self, request):
        request.i += 1
        if request.i > len(request.chunks):
            return Chunk("", done=True, finish_reason="eos")
        return Chunk(request.chunks[request.i - 1])


def run(member: Member, chunks: list[str], **kw):
    method = Scripted([member], chunks, **kw)
    stream = method.stream("hi")
    parts = list(stream)
    return parts, stream.result


def test_stop_string_across_chunks_is_cut_and_never_emitted(tiny_llama: Member) -> None:
    parts, result = run(tiny_llama, [" Hello", " wor", "ld\nUs", "er: more"], stop=["\nUser:"])
    assert result.text == "Hello world" and result.finish_reason == "stop"
    assert "".join(parts) == result.text
    assert all("\n" not in p for p in parts)


def test_leading_whitespace_dropped_and_eos(tiny_llama: Member) -> None:
    parts, result = run(tiny_llama, ["  ", "\n", " Yes", " sir"])
    assert result.text == "Yes sir" and result.finish_reason == "eos" and "".join(parts) == "Yes sir"


def test_partial_character_is_held_back(tiny_llama: Member) -> None:
    parts, result = run(tiny_llama, ["A\ufffd", "", "B"])
    assert parts[0] == "A"


def test_holdback() -> None:
    assert _holdback("abc\nUs", ["\nUser:"]) == 3
    assert _holdback("abc", ["\nUser:"]) == 0
    assert _holdback("x#", ["##", "#!"]) == 1


def test_cancel_stops_generation(tiny_llama: Member) -> None:
    method = Scripted([tiny_llama], ["a"] * 100)
    cancel = threading.Event()
    stream = method.stream("hi", cancel=cancel)
    first = next(iter(stream))
    cancel.set()
    rest = list(stream)
    assert stream.result.finish_reason == "cancelled" and stream.result.text == first + "".join(rest)
    assert len(stream.result.text) < 100


@pytest.mark.parametrize(
    "bad",
    [dict(max_new_tokens=0), dict(temperature=-1), dict(temperature=float("inf")), dict(max_new_tokens="10"),
     dict(max_new_tokens=True),
     dict(top_p=1.5), dict(stop=[""]), dict(seed="x")],
)
def test_bad_generation_config_raises_typed_error(bad) -> None:
    with pytest.raises(InvalidOptionError) as err:
        GenerationConfig(**bad)
    assert next(iter(bad)) in str(err.value)


def test_unknown_override_is_named(tiny_llama: Member) -> None:
    with pytest.raises(ConfigurationError, match="lookahed"):
        Ensemble([tiny_llama], method="single", lookahed=3)


def test_no_members_and_unknown_method() -> None:
    with pytest.raises(NoMembersError, match="at least 1"):
        Ensemble([], method="single")
    with pytest.raises(InvalidOptionError, match="method"):
        Ensemble(["x"], method="nope")


def test_single_model_stream_equals_generate_and_counts(tiny_gemma: Member) -> None:
    ens = Ensemble([tiny_gemma], method="single", max_new_tokens=12)
    result = ens.generate("Tell me a story")
    stream = ens.stream("Tell me a story")
    assert "".join(stream) == result.text and stream.result.text == result.text
    assert result.finish_reason in ("length", "eos", "stop")
    assert result.prompt_tokens > 0 and result.stats["tokens"] <= 12
    assert ens.batch(["Tell me a story", "Hi"])[0].text == result.text


def _sampled_before(probs: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """How a token was sampled before #38 (``torch.multinomial`` on the host): the reference of the draws."""
    p = torch.pow(probs.clamp_min(1e-30), 1.0 / temperature) if temperature != 1.0 else probs
    p = p / p.sum()
    if top_p < 1.0:
        sorted_p, order = torch.sort(p, descending=True)
        sorted_p[torch.cumsum(sorted_p, 0) - sorted_p > top_p] = 0.0
        p = torch.zeros_like(p).scatter_(0, order, sorted_p)
        p = p / p.sum()
    return int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_a_draw_on_the_device_is_the_draw_torch_multinomial_makes(temperature: float, top_p: float) -> None:
    """``sample_ids`` reads nothing (a draft keeps sampled ids on the device, #38) and draws what
    ``torch.multinomial`` draws from the same generator, leaving it in the same state: on a CPU a seeded
    request writes what it wrote before."""
    config = GenerationConfig(do_sample=True, temperature=temperature, top_p=top_p)
    rows = torch.softmax(torch.randn(200, 3000, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    for i, probs in enumerate(rows):
        before, now = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        expected = _sampled_before(probs, temperature, top_p, before)
        with HostReads() as reads:
            picked = sample_ids(probs, config, now)
        assert reads.total == 0 and picked.dim() == 0
        assert int(picked) == expected and torch.equal(now.get_state(), before.get_state())
    assert device_generator(now, torch.device("cpu")) is now  # the request's generator draws where it lives
    greedy = GenerationConfig()
    assert int(sample_ids(rows[0], greedy, None)) == int(torch.argmax(rows[0]))


@pytest.mark.parametrize("temperature", [1e-6, 1e-3, 0.02, 10.0])
def test_a_small_temperature_samples_the_top_token_and_a_masked_token_never(temperature: float) -> None:
    """``p ** (1/T)`` on probabilities underflowed every p < 1 to 0 at a small T: 0/0 gave NaN, and the
    sample was token 0 at every step (Qwen wrote '!!!!!!!!'). A masked token (p = 0, a grammar's) stays
    out at a large T (the old floor of 1e-30 gave it 1e-3 at T = 10)."""
    probs = torch.softmax(torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 4, dim=-1)
    probs[7] = 0.0
    p = transformed(probs, GenerationConfig(do_sample=True, temperature=temperature))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1.0) < 1e-5 and float(p[7]) == 0.0
    picks = {int(sample_ids(probs, GenerationConfig(do_sample=True, temperature=temperature, seed=s),
                            torch.Generator().manual_seed(s))) for s in range(20)}
    if temperature < 0.05:
        assert picks == {int(torch.argmax(probs))}
    else:
        assert 7 not in picks and len(picks) > 1


def test_a_small_temperature_writes_about_the_greedy_text(tiny_llama: Member) -> None:
    greedy = Ensemble([tiny_llama], method="single", max_new_tokens=8).generate("Hello")
    cold = Ensemble([tiny_llama], method="single", max_new_tokens=8, do_sample=True, temperature=1e-6, seed=0)
    assert cold.generate("Hello").stats["tokens"] == greedy.stats["tokens"]


def test_a_request_draws_on_another_device_from_a_generator_seeded_from_its_own() -> None:
    """The request's generator draws where it lives; on another device (a GPU member: here ``cpu:0``, which
    torch tells apart from ``cpu``) from a generator made there once per request, seeded from the request's
    stream: a seeded request stays reproducible there."""
    there = torch.device("cpu", 0)
    first, again = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    made = device_generator(first, there)
    assert made is not first and device_generator(first, there) is made  # one per request and device
    assert torch.equal(device_generator(again, there).get_state(), made.get_state())  # from the request's seed
    assert not torch.equal(device_generator(torch.Generator().manual_seed(4), there).get_state(), made.get_state())
    assert device_generator(None, there) is None  # unseeded: the device's default generator


def test_sampling_is_reproducible_under_a_seed(tiny_llama: Member) -> None:
    ens = Ensemble([tiny_llama], method="single", max_new_tokens=10, do_sample=True, seed=7, temperature=1.5)
    a, b = ens.generate("Hello"), ens.generate("Hello")
    c = ens.generate("Hello", seed=8)
    assert a.text == b.text
    assert a.stats["tokens"] == b.stats["tokens"]
    assert c.text != a.text or c.stats["tokens"] != a.stats["tokens"]
