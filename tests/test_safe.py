"""SAFE (drafter + verifiers, selective ensembling).

* Scripted members (a tiny real transformers model whose logits are replaced by a
  distribution that follows a fixed reply *text*) pin down the stability check, the
  consensus skip, ensembling at a shared boundary and overruling the drafter's EOS.
* Tiny random-weight members with the real tokenizers stress the text handling (random
  byte tokens, CJK, emoji) for every distribution and drafter choice, and check
  streaming, batching, seeding and config errors quickly.
* Real-model tests (``real`` mark) check equivalence with greedy ``generate`` and run the
  bundled pair over varied prompts. Every SAFE run checks the invariants after each round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ensemble_core import Member
from ensemble_core.decoding.drafting import draft_tokens
from ensemble_core.decoding.generation import GenerationResult
from ensemble_core.decoding.pipeline import TokenPipeline
from ensemble_core.ensemble import Ensemble
from ensemble_core.errors import ConfigurationError, InvalidOptionError, NoMembersError
from ensemble_core.methods.safe import SafeConfig, SafeEnsemble, SafeRequest, drafting_levers
from ensemble_core.options import device_type, reliability_mode
from ensemble_core.testing import tiny_member
from ensemble_core.text.alignment import decode, is_common_boundary, tokenize

FFFD = "\ufffd"


# ============================================================================ helpers
class ScriptedLM(torch.nn.Module):
    """A causal LM that writes ``script`` (a text) with probability ``confidence`` per token.

    The forward pass and the KV cache are a tiny real model's, so the core's incremental
    decoding, cropping and re-encoding run for real; each returned row is replaced by a
    distribution with ``confidence`` on the first token (in this model's own tokenizer)
    of what remains of the script after the reply so far, and on EOS once the reply is
    complete or has left the script. The reply is read back from the ids as text, so the
    model follows the script whatever tokenization the ensemble committed.
    """

    def __init__(self, inner: Any, tokenizer: Any, script: str, confidence: float, marker: str) -> None:
        super().__init__()
        self.inner, self.tokenizer, self.script, self.marker = inner, tokenizer, script, marker
        self.confidence = confidence
        self.config = inner.config
        self.generation_config = inner.generation_config
        self._ids: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def get_output_embeddings(self) -> Any:
        return self.inner.get_output_embeddings()

    def next_token(self, ids: list[int]) -> int:
        reply = self.tokenizer.decode(ids, skip_special_tokens=False).rsplit(self.marker, 1)[-1]
        rest = self.script[len(reply):] if self.script.startswith(reply) else ""
        return self.tokenizer(rest, add_special_tokens=False)["input_ids"][0] if rest else self.tokenizer.eos_token_id

    def forward(self, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
        past = cache.get_seq_length() if cache is not None else 0
        self._ids = self._ids[:past] + input_ids[0].tolist()
        out = self.inner(input_ids=input_ids, cache=cache, **kwargs)
        rows, vocab = out.logits.shape[1], out.logits.shape[2]
        rest = torch.log(torch.tensor(max((1 - self.confidence) / (vocab - 1), 1e-12)))
        logits = torch.full_like(out.logits, float(rest))
        for r in range(rows):
            logits[0, r, self.next_token(self._ids[: len(self._ids) - rows + r + 1])] = float(torch.log(
                torch.tensor(self.confidence)))
        out.logits = logits
        return out


def scripted(base: Member, script: str, confidence: float) -> Member:
    chatml = base.tokenizer.chat_template is not None
    marker = "<|im_start|>assistant\n" if chatml else "Assistant:"
    return Member(ScriptedLM(base.model, base.tokenizer, script, confidence, marker), base.tokenizer,
                  name=f"scripted-{base.name}")


def check_round(method: SafeEnsemble, request: SafeRequest, delta: str) -> None:
    """SAFE's invariants after a round."""
    c = request.counters
    assert FFFD not in delta and FFFD not in request.text
    assert c.accepted + c.replaced == c.drafted
    view = request.views[request.drafter]
    if len(view.tokens):
        assert view.tokens.text == view.lead + request.text
    else:
        assert request.text == ""
    assert view.state.ids[view.state.prompt_len:] == list(view.tokens.ids)  # cropped to the committed text
    assert decode(view.member.tokenizer, view.tokens.ids) == view.tokens.text
    assert len(view.tokens) <= request.config.max_new_tokens


def checked(method: SafeEnsemble) -> SafeEnsemble:
    """Check the invariants after every round of ``method`` (wraps its ``step``)."""
    original = method.step

    def step(request: SafeRequest) -> Any:
        chunk = original(request)
        check_round(method, request, chunk.text)
        return chunk

    method.step = step  # type: ignore[method-assign]
    return method


def check_result(result: GenerationResult, max_new_tokens: int) -> None:
    s = result.stats
    assert FFFD not in result.text
    assert s["accepted"] + s["replaced"] == s["drafted"]
    assert s["e_t"] == pytest.approx(s["ensembled"] / s["tokens"] if s["tokens"] else 0.0)
    assert 0 <= s["ensembled"] <= s["drafted"] and s["tokens"] <= max_new_tokens  # one point per drafted token
    assert s["rounds"] >= 1 and [m["role"] for m in s["members"]].count("drafter") == 1
    assert result.finish_reason in ("stop", "length", "eos")


# ============================================================================ config
@pytest.mark.parametrize("option, value", [
    ("drafter", -1), ("drafter", "0"), ("lookahead", 0), ("lookahead", True), ("distribution", "mean"),
    ("top_k", 0), ("top_k", 1001), ("consensus_threshold", 1.5), ("consensus_threshold", "high"), ("sharpening", "max"),
    ("margin", -1), ("max_new_tokens", 0), ("draft_confidence", 1.0), ("draft_confidence", -0.1),
    ("draft_confidence", "0.5"), ("prompt_lookup", -1), ("prompt_lookup", 2.5), ("prompt_lookup", True),
    ("prompt_lookup_max_requests", 0), ("prompt_lookup_max_requests", "1"),
])
def test_bad_config_values_raise_typed_errors(option: str, value: Any) -> None:
    with pytest.raises(InvalidOptionError) as err:
        SafeConfig(**{option: value})
    assert err.value.option == option


def test_defaults_and_member_checks(tiny_llama: Member, tiny_gemma: Member) -> None:
    c = SafeConfig()
    assert (c.drafter, c.lookahead, c.distribution, c.top_k, c.consensus_threshold, c.sharpening, c.margin) == (
        None, 5, "unite", 10, 0.5, "heuristic", 5)  # drafter None: the most reliable member (tests/test_reliability.py)
    assert not c.do_sample
    with pytest.raises(InvalidOptionError):
        SafeEnsemble([tiny_llama, tiny_gemma], drafter=2)
    with pytest.raises(NoMembersError):
        SafeEnsemble([tiny_llama])
    with pytest.raises(ConfigurationError):
        SafeEnsemble([tiny_llama, tiny_gemma], lookahaed=3)  # misspelt option
    with pytest.raises(InvalidOptionError):
        SafeEnsemble([tiny_llama, tiny_gemma]).generate("Hi", drafter=3)
    assert isinstance(Ensemble([tiny_llama, tiny_gemma], method="safe").method, SafeEnsemble)


def test_reply_lead_comes_from_the_template(tiny_llama: Member, tiny_gemma: Member) -> None:
    assert tiny_llama.response_lead("Hi") == ""  # ChatML: "<|im_start|>assistant\n" + reply
    assert tiny_gemma.response_lead("Hi") == " "  # fallback transcript: "Assistant:" + " " + reply


# ============================================================================ scripted members
def test_stability_refuses_the_point_after_inc(tiny_llama: Member, tiny_gemma: Member) -> None:
    # The real tokenizers: SmolLM2 " Inc|orrect", Gemma " Incorrect".
    smol, gemma = tokenize(tiny_llama.tokenizer, "That is Incorrect."), tokenize(tiny_gemma.tokenizer, "That is Incorrect.")
    assert smol.is_boundary(11) and not is_common_boundary(11, [gemma])  # after "That is Inc"
    assert all(is_common_boundary(o, [smol, gemma]) for o in (0, 4, 7, 17, 18))

    drafter = scripted(tiny_llama, "That is Incorrect.", confidence=0.6)
    verifier = scripted(tiny_gemma, " That is Incorrect.", confidence=0.6)
    method = checked(SafeEnsemble([drafter, verifier], consensus_threshold=1.0, max_new_tokens=20))
    result = method.generate("Is 2 + 2 = 5?")
    assert result.text == "That is Incorrect." and result.finish_reason == "eos"
    s = result.stats
    # points: before That, is, Inc, orrect, ".", EOS; the one before "orrect" is OOV-like for Gemma
    assert (s["skipped_oov"], s["skipped_consensus"], s["ensembled"]) == (1, 5, 0)
    assert (s["drafted"], s["accepted"], s["tokens"], s["rounds"]) == (6, 6, 5, 2)


def test_ensembles_at_a_shared_boundary_and_can_overrule_the_drafters_eos(tiny_llama: Member,
                                                                          tiny_gemma: Member) -> None:
    drafter = scripted(tiny_llama, "That is Incorrect.", confidence=0.6)
    verifier = scripted(tiny_gemma, " That is wrong.", confidence=0.9)
    # the published uniform vote (with the default prior Gemma, which has no chat template, weighs 0.2:
    # tests/test_reliability.py)
    method = checked(SafeEnsemble([drafter, verifier], max_new_tokens=20, reliability="none"))
    result = method.generate("Is 2 + 2 = 5?")
    # after "That is" the members disagree (average 0.3 < 0.5): fused " wrong" 0.45 beats " Inc" 0.3;
    # then the drafter (off its script) wants EOS with 0.6, the verifier "." with 0.9: "." wins.
    assert result.text == "That is wrong." and result.finish_reason == "eos"
    s = result.stats
    assert s["ensembled"] == 2 and s["skipped_oov"] == 0
    assert s["tokens"] == len(tiny_llama.tokenizer("That is wrong.", add_special_tokens=False)["input_ids"])
    check_result(result, 20)


def test_gac_variant_skips_where_the_drafter_is_confident(tiny_llama: Member, tiny_gemma: Member) -> None:
    drafter = scripted(tiny_llama, "That is Incorrect.", confidence=0.6)
    verifier = scripted(tiny_gemma, " That is wrong.", confidence=0.9)
    result = checked(SafeEnsemble([drafter, verifier], distribution="gac", max_new_tokens=20)).generate("Is 2 + 2 = 5?")
    assert result.text == "That is Incorrect." and result.stats["ensembled"] == 0  # drafter p = 0.6 >= 0.5


# ============================================================================ tiny random members
PROMPTS = ["Say 東京 and 😀 twice.", "Write a Python function that adds two numbers.", "Wie heißt du?"]


@pytest.mark.parametrize("distribution", ["unite", "gac"])
@pytest.mark.parametrize("drafter", [0, 1])
def test_random_members_never_commit_broken_text(tiny_llama: Member, tiny_gemma: Member, distribution: str,
                                                 drafter: int) -> None:
    method = checked(SafeEnsemble([tiny_llama, tiny_gemma], drafter=drafter, distribution=distribution,
                                  consensus_threshold=1.0, max_new_tokens=12))
    result = method.generate(PROMPTS[0])
    check_result(result, 12)
    assert result.stats["ensembled"] > 0  # random members disagree everywhere


def test_streaming_equals_generate_and_batch_equals_one_by_one(tiny_llama: Member, tiny_gemma: Member) -> None:
    method = checked(SafeEnsemble([tiny_llama, tiny_gemma], consensus_threshold=1.0, max_new_tokens=8))
    singles = [method.generate(p) for p in PROMPTS]
    for prompt, single in zip(PROMPTS, singles):
        stream = method.stream(prompt)
        deltas = list(stream)
        assert "".join(deltas) == single.text == stream.result.text
        assert stream.result.stats == {**single.stats, "members": stream.result.stats["members"]}
    assert [r.text for r in method.batch(PROMPTS)] == [r.text for r in singles]


def test_sampling_is_reproducible_under_a_seed(tiny_llama: Member, tiny_gemma: Member) -> None:
    method = checked(SafeEnsemble([tiny_llama, tiny_gemma], max_new_tokens=6, do_sample=True, temperature=5.0))
    a, b = method.generate("Hi", seed=7), method.generate("Hi", seed=7)
    assert a.text == b.text and a.stats["drafted"] == b.stats["drafted"]
    assert method.generate("Hi", seed=8).text != a.text  # 6 tokens drawn from ~50k-way distributions


@pytest.mark.parametrize("drafter", [0, 1])  # SmolLM2's full cache, Gemma-3's sliding layers
def test_prompt_lookup_drafts_the_same_text_in_fewer_passes(tiny_llama: Member, tiny_gemma: Member,
                                                            drafter: int) -> None:
    """Guessed tokens only save passes: greedy and seeded sampling write the same text, rounds
    keep their invariants (the drafter cropped to the committed text), and guesses came true."""
    prompt = "Repeat: la la la la la la la la la la la la."
    runs = {}
    for lookup in (0, 4):
        method = checked(SafeEnsemble([tiny_llama, tiny_gemma], drafter=drafter, consensus_threshold=1.0,
                                      max_new_tokens=24, prompt_lookup=lookup, draft_confidence=0.0))
        greedy = method.generate(prompt)
        sampled = method.generate(prompt, do_sample=True, temperature=0.7, seed=3)
        check_result(greedy, 24)
        own = next(m for m in greedy.stats["members"] if m["role"] == "drafter")
        runs[lookup] = (greedy.text, sampled.text, greedy.stats["drafted"], own["forward_passes"], own["reprefills"])
    assert runs[4][:3] == runs[0][:3]
    assert runs[4][3] < runs[0][3]  # fewer drafter passes
    assert runs[4][4] == runs[0][4] == 0  # crops stayed exact


def test_a_candidate_one_member_cannot_spell_is_not_allowed_under_a_grammar() -> None:
    """Gemma-3's vocabulary holds ``'\\x14'``, which SmolLM2's tokenizer cannot spell: at an ensemble point
    under ``json_object`` that candidate stopped the request with a ConstraintError ("cannot spell ... byte for
    byte") mid-answer; it is a candidate the member's grammar cannot follow, so it is not allowed."""
    llama = tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)
    gemma = tiny_member("gemma3-270m", seed=1, initializer_range=0.2)
    result = Ensemble([llama, gemma], method="safe").generate("Make up an order.", max_new_tokens=160,
                                                              response_format={"type": "json_object"})
    assert result.finish_reason == "eos" and isinstance(result.parsed, dict)
    assert result.stats["ensembled"] > 0


@pytest.mark.parametrize("device, kind", [
    ("cpu", "cpu"), (torch.device("cuda", 1), "cuda"), ("mps", "mps"), ("ray:10.0.0.2/cuda:0/7f3a", "cuda"),
    ("ray:node/cpu/1", "cpu"),
])
def test_device_type_reads_local_and_ray_devices(device: Any, kind: str) -> None:
    assert device_type(device) == kind


def test_drafting_levers_are_the_measured_defaults_on_a_cpu_and_published_elsewhere() -> None:
    """CPU: prompt lookup 4 and drafts ended below 0.5 (measured faster, docs/configuration.md); a GPU
    keeps the published 0 / 0 until measured there; ``published=True`` and explicit values win."""
    assert drafting_levers(SafeConfig(), "cpu") == (4, 0.5)
    assert drafting_levers(SafeConfig(), "cuda:0") == (0, 0.0)
    assert drafting_levers(SafeConfig(published=True), "cpu") == (0, 0.0)
    assert drafting_levers(SafeConfig(prompt_lookup=2, published=True), "cpu") == (2, 0.0)
    assert drafting_levers(SafeConfig(draft_confidence=0.0), "cpu") == (4, 0.0)
    assert drafting_levers(SafeConfig(prompt_lookup=0, draft_confidence=0.3), "cuda") == (0, 0.3)


def test_published_survives_per_call_overrides(tiny_llama: Member, tiny_gemma: Member) -> None:
    """Defaults are resolved where they are read: a config re-made for one call (``dataclasses.replace``)
    keeps ``published=True`` meaning uniform votes and the published drafting."""
    ensemble = Ensemble([tiny_llama, tiny_gemma], method="safe", published=True, max_new_tokens=6)
    assert reliability_mode(ensemble.config) == "none" and reliability_mode(SafeConfig()) == "prior"
    assert reliability_mode(SafeConfig(published=True, reliability="prior")) == "prior"
    published = ensemble.generate("Hi", max_new_tokens=4).stats
    default = Ensemble([tiny_llama, tiny_gemma], method="safe", max_new_tokens=6).generate("Hi", max_new_tokens=4).stats
    assert (published["reliability"], published["prompt_lookup"], published["draft_confidence"]) == ("none", 0, 0.0)
    assert (default["reliability"], default["prompt_lookup"], default["draft_confidence"]) == ("prior", 4, 0.5)
    with pytest.raises(InvalidOptionError, match="published"):
        SafeConfig(published="yes")


# ============================================================================ real models
def greedy_ids(member: Member, prompt: str, max_new_tokens: int) -> list[int]:
    ids = member.encode_prompt(member.render(prompt))
    with torch.inference_mode():
        out = member.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    return [t for t in new if t not in member.eos_token_ids]


def drive(method: SafeEnsemble, prompt: str) -> SafeRequest:
    """Run a request round by round (checking invariants) and return it."""
    request = method.begin(prompt, method.config)
    while True:
        chunk = method.step(request)
        check_round(method, request, chunk.text)
        if chunk.done:
            return request


@pytest.mark.real
def test_threshold_zero_reproduces_the_drafters_greedy_tokens(real_pair: list[Member]) -> None:
    prompt = "Name three primary colors."
    method = SafeEnsemble(real_pair, consensus_threshold=0.0, max_new_tokens=32)
    request = drive(method, prompt)
    assert list(request.views[0].tokens.ids) == greedy_ids(real_pair[0], prompt, 32)
    assert request.counters.ensembled == 0


@pytest.mark.real
def test_draft_confidence_ends_drafts_after_an_unsure_token(smollm2: Member) -> None:
    """Every drafted token but the last has at least the threshold; the last is unsure, or the draft is full."""
    config = SafeConfig()
    lengths = []
    for prompt in ("Name three primary colors.", "Write a haiku about rain.", "What is 17 * 23? Think step by step."):
        state = smollm2.start(prompt)
        ids, rows = draft_tokens(state, 6, 40, TokenPipeline(config), confidence=0.6)
        probs = [rows.prob(j, t) for j, t in enumerate(ids)]
        assert all(p >= 0.6 for p in probs[:-1]), probs
        assert probs[-1] < 0.6 or len(ids) == 6, probs
        lengths.append(len(ids))
    assert min(lengths) < 6  # the threshold did cut a draft here


@pytest.mark.real
@pytest.mark.parametrize("lever, prompt, tokens", [
    ({"draft_confidence": 0.9}, "Name three primary colors.", 32),
    ({"prompt_lookup": 4}, "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", 40),
])
def test_drafting_levers_keep_the_drafters_greedy_tokens(real_pair: list[Member], lever: dict, prompt: str,
                                                          tokens: int) -> None:
    """With consensus_threshold 0 SAFE writes the drafter's greedy text: shorter drafts change the
    rounds (``draft_confidence``), guessed tokens the drafter's passes (``prompt_lookup``), not the text."""
    plain = drive(SafeEnsemble(real_pair, consensus_threshold=0.0, max_new_tokens=tokens, published=True), prompt)
    pulled = drive(SafeEnsemble(real_pair, consensus_threshold=0.0, max_new_tokens=tokens, published=True, **lever),
                   prompt)
    assert list(pulled.views[0].tokens.ids) == list(plain.views[0].tokens.ids) == greedy_ids(real_pair[0], prompt, tokens)
    if "draft_confidence" in lever:
        assert pulled.counters.rounds > plain.counters.rounds
    else:
        passes = [r.views[0].state.stats.forward_passes for r in (plain, pulled)]
        assert passes[1] < 0.8 * passes[0], passes


@pytest.mark.real
def test_prompt_lookup_leaves_the_drafter_at_its_draft(smollm2: Member) -> None:
    """After a draft with guesses the state holds the prompt and every drafted id but the last,
    and its next row is the one a state that never saw the guesses computes."""
    prompt = "Count: one two three, one two three, one two three, one two"
    state = smollm2.start(prompt)
    base = list(state.ids)
    ids, rows = draft_tokens(state, 8, 40, TokenPipeline(SafeConfig()), lookup=6)
    assert state.ids == base + ids[:-1]
    fresh = smollm2.start_from_ids(base)
    plain, _ = draft_tokens(fresh, 8, 40, TokenPipeline(SafeConfig()))
    assert plain == ids and state.stats.forward_passes < fresh.stats.forward_passes
    torch.testing.assert_close(state.score([ids[-1]])[-1], fresh.score([ids[-1]])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.real
def test_two_copies_of_a_model_equal_its_greedy_output(smollm2: Member) -> None:
    prompt = "What is the capital of Italy?"
    request = drive(SafeEnsemble([smollm2, smollm2], max_new_tokens=32), prompt)
    assert list(request.views[0].tokens.ids) == greedy_ids(smollm2, prompt, 32)
    # The drafter may write a non-canonical split (" Cor|io|b|ella" where re-encoding gives
    # " Cor|i|ob|ella"), so the verifier twin can disagree and points get ensembled; the fused
    # distribution of twins still picks the drafter's tokens: nothing is ever replaced.
    assert request.counters.replaced == 0


VARIED = [
    "My name is Zoë Ångström-Nakamura. Repeat my name.",
    "What is 17 times 23?",
    "Convert 3.5 km to meters.",
    "Traduis en français : the cat sleeps on the sofa.",
    "¿Cuál es la capital de España?",
    "東京について一文で説明してください。",
    "Write one sentence with a smiley emoji 😀 in it.",
    "Write a Python function is_even(n).",
    "Привет! Как дела?",
    "List the first five prime numbers.",
]


@pytest.mark.real
def test_real_pair_on_varied_prompts(real_pair: list[Member]) -> None:
    totals = {"ensembled": 0, "tokens": 0}
    for i, prompt in enumerate(VARIED):
        method = checked(SafeEnsemble(real_pair, drafter=i % 2, distribution="gac" if i % 3 == 2 else "unite",
                                      max_new_tokens=16))
        result = method.generate(prompt)
        check_result(result, 16)
        assert result.text.strip(), prompt
        totals["ensembled"] += result.stats["ensembled"]
        totals["tokens"] += result.stats["tokens"]
    assert totals["ensembled"] < totals["tokens"]  # selective: not every token is ensembled


@pytest.mark.real
def test_real_streaming_equals_generate(real_pair: list[Member]) -> None:
    method = checked(SafeEnsemble(real_pair, drafter=1, max_new_tokens=12))
    prompt = "Give two fruits, one per line."
    stream = method.stream(prompt)
    assert "".join(stream) == method.generate(prompt).text == stream.result.text
