"""The lazy tool-call grammar of ``tool_choice="auto"`` (#39, items 1, 4, 5), without real models.

* **Triggers and activation** on one member's pipeline, token by token with the real
  tokenizers: free text stays free (the logits are untouched), a trigger activates the
  call grammar where it ends (also inside a token), the grammar masks the call's tokens in
  the member's own vocabulary, Qwen's ``</tool_call>`` token closes a tagged call, and the
  text is free again after the call. Drafts: an activation inside a rejected draft is undone
  by ``restore``. Committed text that runs past the call's end leaves the rest free.
* **Every method**: scripted members (tiny models whose logits are a one-hot on a scripted
  reply) write calls that break the tool's schema; under the lazy grammar every method
  (single, SAFE, every-token, SpecEM, generate-then-select) returns a call that parses,
  and text-only replies are unchanged.
* **Repeated calls**: a call whose result is in the history may close, then the member must
  answer (triggers and the end of the reply masked until it has written text), and the
  adapters drop the repeat; ``exclude_repeated_calls=False`` keeps it.
* **tool_choice="none"**: a token that would complete a trigger is masked.
* **Streaming**: call pieces (name, then argument text) while the call is decoded, break text
  for a call that does not parse; LangChain's merge gives the right ``tool_calls`` /
  ``invalid_tool_calls``.
* **LlamaIndex contract**: an invalid call is never an answer.
"""

from __future__ import annotations

import functools
import json
import operator
from typing import Any

import pytest
import torch
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_ensemble import ChatEnsemble
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, ChatResponse
from llama_index.core.tools import FunctionTool
from llama_index.llms.ensemble import EnsembleLLM
from llama_index.llms.ensemble.messages import INVALID_CALL, assistant_message, to_core_messages
from test_llamaindex_agent import ScriptedLM

from ensemble_core import Ensemble, Member
from ensemble_core.bench.host_reads import HostReads
from ensemble_core.constraints.grammar import JsonConstraint, compile_for_member, tool_call_constraint
from ensemble_core.constraints.lazy import (
    ANSWER_REQUEST,
    LazyCalls,
    answered_calls,
    canonical_arguments,
    drop_repeated_calls,
    find_trigger,
    lazy_calls,
    trigger_tail,
)
from ensemble_core.constraints.structured import CallDelta, ReplyStream, parse_output, structured_request
from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.pipeline import MAX_FORCED, TokenPipeline
from ensemble_core.errors import InvalidOptionError
from ensemble_core.testing import tiny_member

QWEN, SMOL = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
MULTIPLY = {"name": "multiply", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}
CAPITAL = {"name": "capital", "description": "The capital city of a country.", "parameters": {
    "type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}
TOOLS = [{"type": "function", "function": MULTIPLY}, {"type": "function", "function": CAPITAL}]
CALL = '{"name": "multiply", "arguments": {"a": 6, "b": 7}}'


@functools.cache
def member(alias: str) -> Member:
    return tiny_member(alias, seed=3, name=f"lazy-{alias}")


VALUE = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"],
         "additionalProperties": False}


def pipeline(alias: str, forbid: bool = False, excluded: tuple[tuple[str, str], ...] = (),
             answer: dict | None = None) -> TokenPipeline:
    calls = LazyCalls((MULTIPLY, CAPITAL), forbid=forbid, excluded=excluded,
                      answer=None if answer is None else JsonConstraint(answer))
    return TokenPipeline(GenerationConfig(), calls=calls.start(member(alias), budget=64))


def ids(alias: str, text: str) -> list[int]:
    return list(member(alias).tokenizer(text, add_special_tokens=False)["input_ids"])


def allowed(p: TokenPipeline) -> torch.Tensor:
    return torch.isfinite(p.process(torch.zeros(member_of(p).vocab_size)))


def member_of(p: TokenPipeline) -> Member:
    return p.calls.member


# ----------------------------------------------------------------------------- triggers
def test_triggers_and_the_tails_that_may_still_become_one() -> None:
    found = {t: find_trigger(t) for t in (b'Ok <tool_call>\n{"na', b'Sure.\n```json\n{"name": "x"', b'  {"name"',
                                          b'a\n{ "name"', b'a {"name"', b'{"names"', b'```python\nx = {"name": 1}')}
    assert {t: (f[0].name, f[1].start("g")) if f else None for t, f in found.items()} == {
        b'Ok <tool_call>\n{"na': ("hermes", 14), b'Sure.\n```json\n{"name": "x"': ("fence", 6), b'  {"name"': ("json", 2),
        b'a\n{ "name"': ("json", 2), b'a {"name"': None, b'{"names"': None, b'```python\nx = {"name": 1}': None}
    assert [trigger_tail(t) for t in ("Let me <tool", "ok ``", "ok ```js", "ok\n{\"na", "ok {\"na", "done.", "a <b")] == \
        [7, 3, 3, 3, 7, 5, 4]


# ----------------------------------------------------------------------------- activation, token by token
@pytest.mark.parametrize("alias", [QWEN, SMOL])
def test_free_text_is_untouched_and_a_tagged_call_is_constrained_to_its_end(alias: str) -> None:
    p = pipeline(alias)
    logits = torch.randn(member(alias).vocab_size)
    text = "Let me check. "
    for token in ids(alias, text):
        assert p.process(logits) is logits  # free text: the same tensor, no mask
        p.accept(token)
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    tokens = ids(alias, call)
    opened = next(i for i in range(1, len(tokens) + 1) if member(alias).tokenizer.decode(tokens[:i]).endswith("<tool_call>"))
    for token in tokens[:opened]:
        p.accept(token)
    assert p.calls.active is not None and p.calls.activations == 1
    mask = allowed(p)
    assert 0 < int(mask.sum()) < 1000  # whitespace or "{" only, in this member's vocabulary
    for token in tokens[opened:]:
        assert bool(allowed(p)[token]), member(alias).tokenizer.decode([token])
        p.accept(token)
    assert p.calls.active is None and p.calls.completed == 1 and p.calls.broken == 0
    # after the call: whitespace, another call or the end (llama.cpp's tool_call+); a member whose first
    # choice is prose ends the reply (its next call is not its choice), one whose first choice is a call goes on
    prose, newline, opener = ids(alias, " The")[0], ids(alias, "\n")[0], ids(alias, "<tool_call>")[0]
    eos = min(member(alias).eos_token_ids)
    vocab = member(alias).vocab_size

    def kept(order: list[int]) -> list[int]:
        scores = torch.zeros(vocab)
        scores[order] = torch.arange(len(order), 0, -1, dtype=torch.float) + 10  # the first ranks highest
        return [t for t in (prose, newline, opener, eos) if torch.isfinite(p.process(scores))[t]]

    assert kept([prose, newline, opener]) == [eos]
    assert kept([newline, opener, prose]) == [newline, opener, eos]
    assert kept([opener, prose, newline]) == [opener, eos]
    assert p.calls.allows("\n", b"<tool_call>") and not p.calls.allows("\n", b"The answer") and p.calls.allows("", None)
    p.accept(newline)
    assert kept([opener, prose]) == [opener, eos] and kept([prose, opener]) == [eos]
    p.calls.commit("The answer is 42.")  # committed without the mask (a method's choice): free from there
    assert p.calls.strayed == 1 and p.process(logits) is logits


def test_after_a_call_a_second_call_in_every_format_may_follow() -> None:
    """The rule after a call lets another call start in each format: Qwen's tag, a fence, a JSON line
    (indented too), and the tails that may still become one; not prose, not an object on the call's line."""
    p = pipeline(SMOL)
    p.calls.commit('{"name": "multiply", "arguments": {"a": 6, "b": 7}}')
    assert p.calls.completed == 1 and p.calls.call_end is not None
    ok = ["\n", "\n\n<tool_call>", "\n<tool", "\n```json\n{", "\n``", "\n{\"name\"", "\n  {\"na", "\n{"]
    bad = ["\nThe", " {\"name\"", "\n<b>", "\n```python", "\nI called", "."]
    assert all(p.calls.allows("", t.encode()) for t in ok), [t for t in ok if not p.calls.allows("", t.encode())]
    assert not any(p.calls.allows("", t.encode()) for t in bad), [t for t in bad if p.calls.allows("", t.encode())]
    p.calls.commit('\n{"name": "capital", "arguments": {"country": "Peru"}}')
    assert p.calls.completed == 2 and p.calls.strayed == 0


@pytest.mark.parametrize("alias", [QWEN, SMOL])
def test_under_a_response_format_the_reply_is_the_value_or_calls_never_prose(alias: str) -> None:
    """Tools in ``auto`` and a schema: before any call a member may write the schema's value or start a call,
    whichever it ranks higher, not prose; the reply ends only on a complete value; a trigger makes it calls."""
    p = pipeline(alias, answer=VALUE)
    prose, brace, opener = ids(alias, "The")[0], ids(alias, "{")[0], ids(alias, "<tool_call>")[0]
    newline, eos, vocab = ids(alias, "\n")[0], min(member(alias).eos_token_ids), member(alias).vocab_size

    def kept(order: list[int]) -> list[int]:
        scores = torch.zeros(vocab)
        scores[order] = torch.arange(len(order), 0, -1, dtype=torch.float) + 10  # the first ranks highest
        return [t for t in (prose, brace, opener, newline, eos) if torch.isfinite(p.process(scores))[t]]

    assert kept([prose, brace, opener, newline]) == [brace]  # prose first: the value, not the call it ranks next
    assert kept([opener, prose, brace]) == [brace, opener] and kept([newline, opener]) == [brace, opener, newline]
    assert p.calls.allows("", b"{") and p.calls.allows("", b"<tool_call>") and p.calls.allows("\n\n", b"{")
    assert not p.calls.allows("", b"The") and not p.calls.allows("", None) and not p.calls.allows('{"value": 4', None)
    mark = p.checkpoint()
    p.commit('\n{"value": 4')  # leading whitespace, then the value: the value's grammar follows
    assert p.calls.value is not None and p.calls.value.text == b'{"value": 4' and kept([prose, opener]) == [newline]
    assert p.calls.allows("2}", None) and not p.calls.allows("2} and", None)
    p.commit("2}")
    assert kept([prose, brace, eos]) == [eos] and p.calls.unvalued == 0  # a complete value: only the end
    p.restore(mark)
    assert p.calls.owes and p.calls.value is not None and p.calls.value.text == b""
    for token in ids(alias, '<tool_call>\n{"name": "multiply"'):
        p.accept(token)
    assert not p.calls.owes and p.calls.value is None and p.calls.active is not None  # the reply is a call
    p.restore(mark)
    p.commit("The answer is 42.")  # committed without the mask (a method's choice): free from there
    assert p.calls.unvalued == 1 and not p.calls.owes
    logits = torch.randn(vocab)
    assert p.process(logits) is logits


def test_a_value_split_inside_a_character_is_followed_byte_by_byte() -> None:
    """A byte-level member writes a rare character in pieces; the value's grammar follows the bytes."""
    p = pipeline(SMOL, answer={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    for token in ids(SMOL, '{"city": "東京"}'):
        assert bool(torch.isfinite(p.process(torch.zeros(member(SMOL).vocab_size)))[token])
        p.accept(token)
    assert p.calls.value is not None and p.calls.value.can_end and p.calls.unvalued == 0


def test_a_wrong_argument_is_masked_and_the_end_of_the_reply_waits_for_the_call() -> None:
    p = pipeline(SMOL)
    for token in ids(SMOL, '{"name": "multiply", "arguments": {"a": '):
        p.accept(token)
    mask = allowed(p)
    assert not mask[ids(SMOL, '"')[0]] and mask[ids(SMOL, "6")[0]]  # a number, not a string
    assert not any(mask[i] for i in member(SMOL).eos_token_ids)  # no end inside the call
    assert p.calls.active is not None and p.calls.fmt.name == "json"


def test_the_trigger_may_end_inside_a_token_and_qwens_closing_token_closes_the_tag() -> None:
    p = pipeline(QWEN)
    for token in ids(QWEN, '{"name'):
        p.accept(token)
    assert p.calls.active is None
    p.accept(ids(QWEN, '":')[0])  # '":' completes the trigger '{"name"' and goes one character further
    assert p.calls.active is not None and p.calls.active.text == b'{"name":'
    p2 = pipeline(QWEN)
    for token in ids(QWEN, '<tool_call>\n{"name": "capital", "arguments": {"country": "Peru"}}\n'):
        p2.accept(token)
    closer = member(QWEN).tokenizer.convert_tokens_to_ids("</tool_call>")
    assert bool(allowed(p2)[closer])  # an added token the engine never allows as text: allowed where the tag closes
    p2.accept(closer)
    assert p2.calls.active is None and p2.calls.completed == 1


def test_an_activation_inside_a_rejected_draft_is_undone() -> None:
    p = pipeline(QWEN)
    p.commit("Sure. ")
    mark = p.checkpoint()
    for token in ids(QWEN, "<tool_call>\n{"):
        p.accept(token)
    assert p.calls.active is not None
    p.restore(mark)
    assert p.calls.active is None and p.calls.text == b"Sure. " and p.calls.activations == 0
    p.commit("The answer is 42.")  # what the ensemble kept instead
    assert p.calls.active is None and p.process(torch.zeros(3)).tolist() == [0, 0, 0]


def test_committed_text_past_the_call_is_free_again_and_a_second_call_starts_again() -> None:
    p = pipeline(SMOL)
    p.commit(CALL + "\nThat is all.")
    assert p.calls.active is None and p.calls.completed == 1
    assert p.calls.done == [("multiply", canonical_arguments({"a": 6, "b": 7}))]
    p.commit('\n{"name": "capital", "arguments": {"country": ')
    assert p.calls.active is not None and p.calls.activations == 2
    p.commit("42")  # committed without the mask (not a string): the call is lost, the text stays free
    assert p.calls.active is None and p.calls.broken == 1


def test_ensemble_points_filter_candidates_by_the_active_call() -> None:
    from ensemble_core.text.distributions import Candidates, EndOfText

    p = pipeline(SMOL)
    keys = (b"6", b'"six"', EndOfText(), b"Hello")
    candidates = Candidates(keys, torch.full((2, 4), 0.25), torch.full((4,), 0.25), torch.ones(4, dtype=torch.bool))
    assert p.allowed_candidates(candidates).keys == keys  # free: everything
    kept = p.allowed_candidates(candidates, prefix='{"name": "multiply", "arguments": {"a": ')
    assert kept is not None and kept.keys == (b"6",)
    assert p.calls.text == b""  # the check moved nothing


# ----------------------------------------------------------------------------- repeats and "none"
def test_answered_calls_come_from_the_history() -> None:
    history = [{"role": "user", "content": "6 times 7?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "name": "multiply", "arguments": {"a": 6, "b": 7}},
                   {"id": "c2", "name": "capital", "arguments": {"country": "Peru"}}]},
               {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    six_seven = ("multiply", canonical_arguments({"a": 6.0, "b": 7}))
    fed_back = {("multiply", canonical_arguments({"a": 42, "b": 7})), ("multiply", canonical_arguments({"a": 6, "b": 42}))}
    assert answered_calls(history)[0] == six_seven and set(answered_calls(history)[1:]) == fed_back  # c2 has no result
    reverse = {"id": "r", "name": "reverse", "arguments": {"text": "stressed"}}
    texts = [{"role": "assistant", "content": "", "tool_calls": [reverse]},
             {"role": "tool", "content": "desserts", "tool_call_id": "r"}]
    assert ("reverse", canonical_arguments({"text": "desserts"})) in answered_calls(texts)  # its own result fed back
    request = structured_request(TOOLS)
    assert lazy_calls(request, history).excluded == answered_calls(history)
    assert lazy_calls(request, history, exclude_repeated=False).excluded == ()
    assert lazy_calls(structured_request(TOOLS, "none"), history).forbid
    assert lazy_calls(structured_request(TOOLS, "multiply"), history) is None  # forced: the eager grammar
    with pytest.raises(InvalidOptionError, match="exclude_repeated_calls"):
        GenerationConfig(exclude_repeated_calls="yes")


def test_a_repeated_call_ends_the_reply_and_is_dropped() -> None:
    excluded = (("multiply", canonical_arguments({"a": 6, "b": 7})),)
    p = pipeline(SMOL, excluded=excluded)
    p.commit('{"name": "multiply", "arguments": {"a": 6.0, "b": 7}}')
    assert p.calls.repeats == 1 and p.calls.ended
    assert allowed(p).nonzero().flatten().tolist() == sorted(member(SMOL).eos_token_ids)  # nothing but the end
    assert not p.calls.allows("", b"6 times 7 is 42.") and p.calls.allows("", None)
    fresh = pipeline(SMOL, excluded=excluded)
    fresh.commit('{"name": "multiply", "arguments": {"a": 6, "b": 8}}')  # another call: not a repeat
    assert not fresh.calls.ended and fresh.calls.allows("", b"\n") and fresh.calls.allows("", None)
    # the reply's calls: the repeat is dropped (what the adapters do before asking for the answer)
    output = parse_output(CALL, structured_request(TOOLS))
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "name": "multiply", "arguments": {"a": 6, "b": 7}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert [c.name for c in drop_repeated_calls(output, history)] == ["multiply"]
    assert output.tool_calls == [] and output.content == "" and output.repeated_tool_calls


def test_tool_choice_none_masks_the_tokens_that_start_call_shaped_text() -> None:
    p = pipeline(QWEN, forbid=True)
    tokenizer = member(QWEN).tokenizer
    masked = {}
    for text in ("<tool_call>", '{"', "{", "```json\n{", "The"):
        logits = torch.zeros(member(QWEN).vocab_size)
        token = tokenizer.convert_tokens_to_ids(text) if text == "<tool_call>" else ids(QWEN, text)[-1]
        logits[token] = 10.0
        if text == "```json\n{":
            p.commit("```json\n")
        masked[text] = not bool(torch.isfinite(p.process(logits))[token])
    assert masked == {"<tool_call>": True, '{"': True, "{": True, "```json\n{": True, "The": False}
    p.commit("The product is {6 * 7}.")  # braces inside a line are text
    assert p.calls.blocked == 0 and p.process(torch.zeros(5)).isfinite().all()


# ----------------------------------------------------------------------------- every method, scripted members
def scripted_member(alias: str, reply: Any, name: str) -> Member:
    base = tiny_member(alias, seed=1)
    replies = reply if callable(reply) else (lambda prompt: reply)
    return Member(ScriptedLM(base.model, base.tokenizer, replies), base.tokenizer, name=name,
                  prefix_cache=0)  # ScriptedLM tells requests apart by an empty cache


BAD = '{"name": "multiply", "arguments": {"a": "six", "b": 7, "c": 1}}'  # breaks the schema twice


@pytest.mark.parametrize("method", ["single", "safe", "every-token", "specem", "generate-then-select"])
def test_every_method_completes_a_started_call_under_the_grammar(method: str) -> None:
    members = [scripted_member(SMOL, BAD, "bad-smol")]
    if method != "single":
        members.append(scripted_member(QWEN, "<tool_call>\n" + BAD + "\n</tool_call>", "bad-qwen"))
    ensemble = Ensemble(members, method=method)
    free = ensemble.generate("6 times 7?", tools=TOOLS, max_new_tokens=48, lazy_tool_grammar=False)
    assert not free.tool_calls and free.structured.invalid_tool_calls  # what the members wrote breaks the schema
    result = ensemble.generate("6 times 7?", tools=TOOLS, max_new_tokens=48)
    assert result.finish_reason != "length" and len(result.tool_calls) == 1, result.text
    call = result.tool_calls[0]
    assert call.name == "multiply" and set(call.arguments) == {"a", "b"}  # the values off the script are the mask's pick
    assert all(isinstance(v, (int, float)) for v in call.arguments.values())
    assert not result.structured.invalid_tool_calls


CHATTY = "Let me multiply these two numbers for you. <tool_call>\n" + BAD + "\n</tool_call>"


def calls_of(result: Any) -> list[tuple[str, dict]]:
    return [(call.name, call.arguments) for call in result.tool_calls]  # call ids are drawn per reply


def test_a_call_that_starts_in_an_unread_burst_is_decoded_on_under_its_grammar() -> None:
    """#38: with tools (``tool_choice="auto"``) the free text before a call is drafted with its ids on the
    device and read once; the pipeline follows the ids after the read, and the draft is cut behind the token
    that starts the call and goes on under the call's grammar: the same reply and call as reading every
    token, in fewer reads (single's bursts; SAFE's published drafting)."""
    qwen = scripted_member(QWEN, CHATTY, "chatty-qwen")
    each = Ensemble([qwen], method="single").generate("6 times 7?", tools=TOOLS, max_new_tokens=64)
    assert each.text.startswith("Let me multiply") and len(each.tool_calls) == 1  # the call is the mask's
    burst = Ensemble([qwen], method="single", steps_per_read=16).generate("6 times 7?", tools=TOOLS, max_new_tokens=64)
    assert (burst.text, calls_of(burst)) == (each.text, calls_of(each))
    assert burst.stats["rounds"] < each.stats["rounds"] - 5  # the free text in bursts, the call a token per read
    pair = [scripted_member(SMOL, CHATTY, "chatty-smol"), qwen]
    results = []
    for confidence in (0.0, 0.01):  # published drafting: unread; a draft confidence: read token by token
        ensemble = Ensemble(pair, method="safe", published=True, draft_confidence=confidence, batching=False)
        with HostReads() as reads:
            results.append((ensemble.generate("6 times 7?", tools=TOOLS, max_new_tokens=64), reads.total))
    (unread, unread_reads), (read, read_reads) = results
    assert (unread.text, calls_of(unread)) == (read.text, calls_of(read)) and len(unread.tool_calls) == 1
    assert unread_reads < read_reads, (unread_reads, read_reads)


@pytest.mark.parametrize("method", ["specem", "generate-then-select"])
def test_a_segment_in_which_a_call_starts_is_cut_back_and_drafted_on_under_its_grammar(method: str) -> None:
    """The segments' unread chunks (#38) under lazy calls: the branch is cut back behind the token that starts
    the call and the segment goes on under the call's grammar: the same reply as drafting token by token
    (prompt lookup's loop), with the free text read in chunks, not a token per read (measured: SpecEM 223
    -> 211 reads for this reply, generate-then-select 188 -> 172; most of the rest is the call's grammar)."""
    pair = [scripted_member(SMOL, CHATTY, "chatty-smol"), scripted_member(QWEN, CHATTY, "chatty-qwen")]
    results = []
    for lookup in (0, 2):  # 0: unread chunks; 2: the loop that reads each token (and feeds guesses)
        ensemble = Ensemble(pair, method=method, parallel=False, prompt_lookup=lookup, batching=False)
        with HostReads() as reads:
            results.append((ensemble.generate("6 times 7?", tools=TOOLS, max_new_tokens=64), reads.counts["item"]))
    (unread, unread_tokens), (read, read_tokens) = results
    assert (unread.text, calls_of(unread)) == (read.text, calls_of(read)) and len(unread.tool_calls) == 1
    # the loop reads each token it chooses as a scalar; the chunks read the free text's tokens together
    assert unread.text.startswith("Let me multiply") and unread_tokens < read_tokens - 10, (unread_tokens, read_tokens)


WEATHER = {"name": "weather_forecast", "description": "The forecast for a city.", "parameters": {
    "type": "object", "properties": {"city_name": {"type": "string"}, "temperature_unit": {"enum": ["C", "F"]},
                                     "forecast_days": {"type": "integer"}},
    "required": ["city_name", "temperature_unit", "forecast_days"]}}
FORECAST = ('{"name": "weather_forecast", "arguments": {"city_name": "Lima", "temperature_unit": "C", '
            '"forecast_days": 3}}')


@pytest.mark.parametrize("method", ["single", "safe", "every-token", "specem", "generate-then-select"])
def test_tokens_the_grammar_forces_ride_along_with_the_pass_before_them(method: str, monkeypatch) -> None:
    """#38: where the grammar forces the next bytes (a property name, the only tool's name), every decoding
    path feeds the member's forced tokens with the pass before them and keeps those it chooses anyway:
    the same replies and calls, lazy (``auto``) and forced alike, in fewer passes than one token per pass
    (``TokenPipeline.forced`` switched off)."""
    members = [scripted_member(QWEN, "<tool_call>\n" + FORECAST + "\n</tool_call>", "ff-qwen")]
    if method != "single":
        members.append(scripted_member(SMOL, FORECAST, "ff-smol"))
    tools = [{"type": "function", "function": WEATHER}]

    def run() -> tuple[list[Any], int]:
        options = {"parallel": False} if method in ("specem", "generate-then-select") else {}
        ensemble = Ensemble(members, method=method, batching=False, published=True, **options)
        results = [ensemble.generate("Weather in Lima?", tools=tools, max_new_tokens=64, tool_choice=choice)
                   for choice in ("auto", "required")]
        return [(r.text, calls_of(r)) for r in results], sum(m.forward_passes for r in results for m in r.stats.members)

    replies, passes = run()
    monkeypatch.setattr(TokenPipeline, "forced", lambda self, limit: [])
    one_by_one, passes_one_by_one = run()
    assert replies == one_by_one
    assert [calls[0][0] for _, calls in replies] == ["weather_forecast"] * 2, replies
    assert passes < passes_one_by_one, (passes, passes_one_by_one)


def test_a_grammar_forces_the_names_it_leaves_no_choice_about() -> None:
    """``ConstraintState.forced``: the only tool's name and each property name, in the member's own tokens;
    nothing where the member chooses (a value), after the end, or in free text before a call."""
    smol = member(SMOL)
    state = compile_for_member(tool_call_constraint([{"type": "function", "function": WEATHER}], "required"),
                               smol).start()
    text = lambda ids: smol.tokenizer.decode(ids)  # noqa: E731
    assert state.accept_text('{"') and text(state.forced(8)) == "name"
    assert state.accept_text('name": "') and text(state.forced(8)).startswith("weather")
    assert state.forced(0) == [] and len(state.forced(1)) == 1
    assert state.accept_text('weather_forecast", "arguments": {"') and text(state.forced(8)).startswith("city")
    assert state.accept_text('city_name": "') and state.forced(8) == []  # the value is the member's
    assert state.accept_text('Lima", "temperature_unit": "C", "forecast_days": 3}}') and state.can_end
    assert state.accept_token(min(smol.eos_token_ids)) and state.forced(8) == []
    lazy = lazy_calls(structured_request(TOOLS, "auto"), []).start(smol)
    assert lazy.forced(8) == []  # free text: the member decides whether a call starts
    lazy.commit('Sure. <tool_call>\n{"')
    assert text(lazy.forced(8)) == "name"


def test_a_long_forced_run_is_fed_at_most_max_forced_tokens_at_once() -> None:
    """A ``const`` longer than a captured bucket is forced in runs of at most ``MAX_FORCED`` tokens (with the
    token before them, a pass of at most 16), not in one pass of its whole length."""
    smol = member(SMOL)
    motto = "the quick brown fox jumps over the lazy dog " * 3
    schema = {"type": "object", "properties": {"motto": {"const": motto}}, "required": ["motto"]}
    state = compile_for_member(JsonConstraint(schema), smol).start()
    assert state.accept_text('{"motto": "')
    assert len(state.forced(100)) > MAX_FORCED  # the grammar forces the whole motto
    pipeline = TokenPipeline(GenerationConfig(), grammar=state)
    assert len(pipeline.forced(100)) == MAX_FORCED and len(pipeline.forced(3)) == 3


@pytest.mark.parametrize("method", ["single", "safe", "every-token", "specem"])
def test_text_replies_are_unchanged_by_the_lazy_grammar(method: str) -> None:
    text = "6 times 7 is 42. {braces} and ``` are text too."
    members = [scripted_member(SMOL, text, "text-smol")]
    if method != "single":
        members.append(scripted_member(QWEN, text, "text-qwen"))
    ensemble = Ensemble(members, method=method)
    assert ensemble.generate("hi", tools=TOOLS, max_new_tokens=40).text == ensemble.generate("hi", max_new_tokens=40).text == text


def test_tool_choice_none_answers_in_text_where_the_member_would_imitate_a_call() -> None:
    member_ = scripted_member(SMOL, CALL, "imitator")
    result = Ensemble([member_], method="single").generate("6 times 7?", tools=TOOLS, tool_choice="none", max_new_tokens=30)
    assert '{"name"' not in result.text and not find_trigger(result.text.encode())


# ----------------------------------------------------------------------------- agents with scripted members
@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


@tool("capital")
def capital_tool(country: str) -> str:
    """The capital city of a country."""
    return {"Peru": "Lima"}.get(country, "unknown")


def repeater(prompt: str) -> str:
    """A member that calls, then repeats its call, and answers only when asked in a turn of its own."""
    return "6 times 7 is 42." if ANSWER_REQUEST in prompt else CALL


@pytest.mark.parametrize("stream", [False, True])
def test_langgraph_agent_finishes_when_the_member_repeats_its_call(stream: bool) -> None:
    """The repeated call ends the reply, is dropped, and the answer is asked for: the agent ends on it."""
    from langgraph.prebuilt import create_react_agent

    chat = ChatEnsemble(members=[scripted_member(SMOL, repeater, "repeater")], method="single", max_tokens=64)
    agent = create_react_agent(chat, [multiply])
    question = {"messages": [HumanMessage("6 times 7?")]}
    if stream:  # the model streams (LangGraph's "messages" mode): the answer arrives as text chunks
        messages = []
        for state in agent.stream(question, {"recursion_limit": 6}, stream_mode="values"):
            messages = state["messages"]
    else:
        messages = agent.invoke(question, {"recursion_limit": 6})["messages"]
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert messages[-1].content == "6 times 7 is 42." and not messages[-1].tool_calls
    assert messages[-1].response_metadata["repeated_tool_calls"][0]["name"] == "multiply"
    kept = chat.bind_tools([multiply]).invoke(messages[:3], exclude_repeated_calls=False)
    assert kept.tool_calls and kept.tool_calls[0]["args"] == {"a": 6, "b": 7}  # switched off: the repeat is a call


def json_repeater(prompt: str) -> str:
    """A repeater whose answer turn writes the requested JSON value."""
    return '{"value": 42}' if ANSWER_REQUEST in prompt else CALL


def test_answer_turn_under_a_response_format_is_parsed_and_reaches_create_agent() -> None:
    """With tools and a ``response_format`` (LangChain's ``create_agent(..., response_format=Model)`` binds
    both), a turn that only repeats its call is answered in a turn of its own under the schema's grammar:
    the settled result carries the parsed value, and the agent's ``structured_response`` is the model."""
    from langchain.agents import create_agent
    from pydantic import BaseModel

    from ensemble_core.serving.runtime import Run, settle

    class Product(BaseModel):
        value: float

    schema = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}
    ensemble = Ensemble([scripted_member(SMOL, json_repeater, "json-repeater")], method="single")
    history = [{"role": "user", "content": "6 times 7?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    run = Run(ensemble, history, {"tools": TOOLS, "response_format": schema, "max_new_tokens": 40})
    for _ in run:
        pass
    result = settle(run)
    assert result.structured.repeated_tool_calls and result.structured.tool_calls == []
    assert result.text == '{"value": 42}' and result.parsed == {"value": 42} and result.structured.parse_error is None

    chat = ChatEnsemble(members=[scripted_member(SMOL, json_repeater, "json-repeater-lc")], method="single", max_tokens=64)
    state = create_agent(chat, [multiply], response_format=Product).invoke(
        {"messages": [HumanMessage("6 times 7?")]}, {"recursion_limit": 6})
    assert state["structured_response"] == Product(value=42)
    assert state["messages"][-1].response_metadata["repeated_tool_calls"][0]["name"] == "multiply"


def forced_repeater(prompt: str) -> str:
    """Under a forced call: calls multiply, repeats it once its result is in, and calls capital when the answer is
    asked for (the only other tool then)."""
    return '{"name": "capital", "arguments": {"country": "Peru"}}' if ANSWER_REQUEST in prompt else CALL


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_reply_of_repeats_is_asked_again_among_the_other_tools(stream: bool) -> None:
    """``tool_choice="required"`` (LangChain's ToolStrategy forces a call each turn): a reply that only repeats an
    answered call is asked again with the other tools, still forced; the repeat goes to the metadata. With one
    tool only, the repeat is the call the caller forced and stands."""
    member_ = scripted_member(SMOL, forced_repeater, f"forced-repeater-{stream}")
    chat = ChatEnsemble(members=[member_], method="single", max_tokens=48)
    history = [HumanMessage("6 times 7?"), AIMessage(content="", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7},
                                                                              "id": "c1"}]),
               ToolMessage(content="42", tool_call_id="c1")]
    both = chat.bind_tools([multiply, capital_tool], tool_choice="any")
    message = functools.reduce(operator.add, both.stream(history)) if stream else both.invoke(history)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("capital", {"country": "Peru"})]
    assert message.response_metadata["repeated_tool_calls"][0]["name"] == "multiply" and message.content == ""
    assert len(member_.model.prompts) == 2 and ANSWER_REQUEST in member_.model.prompts[-1]
    alone = scripted_member(SMOL, forced_repeater, f"forced-alone-{stream}")
    only = ChatEnsemble(members=[alone], method="single", max_tokens=48).bind_tools([multiply], tool_choice="any")
    kept = only.invoke(history)
    assert [c["name"] for c in kept.tool_calls] == ["multiply"] and len(alone.model.prompts) == 1


def structured_repeater(prompt: str) -> str:
    """A member that repeats its call until asked for the answer, then calls the response format's tool."""
    return '{"name": "Product", "arguments": {"value": 42}}' if ANSWER_REQUEST in prompt else CALL


def test_create_agent_with_a_tool_strategy_ends_where_the_member_repeats_its_call() -> None:
    """LangChain's ``create_agent(..., response_format=ToolStrategy(Model))`` forces a call every turn; the member's
    repeated call would loop the agent to its recursion limit; asked again among the other tools, it calls the
    response format's tool and the agent returns the model."""
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ToolStrategy
    from pydantic import BaseModel

    class Product(BaseModel):
        value: float

    chat = ChatEnsemble(members=[scripted_member(SMOL, structured_repeater, "tool-strategy")], method="single",
                        max_tokens=48)
    state = create_agent(chat, [multiply], response_format=ToolStrategy(Product)).invoke(
        {"messages": [HumanMessage("6 times 7?")]}, {"recursion_limit": 8})
    assert state["structured_response"] == Product(value=42)
    calls = [c["name"] for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls]
    assert calls == ["multiply", "Product"]


def prose_then_repeat(prompt: str) -> str:
    """A member that announces its call in prose, repeats the answered call, and writes JSON when asked."""
    return '{"value": 42}' if ANSWER_REQUEST in prompt else "Let me check that again.\n" + CALL


def test_prose_before_a_repeated_call_is_answered_again_under_a_response_format() -> None:
    """The repeated call is dropped and the text before it is all that is left: under a ``response_format``
    that text is not the schema's value, so the answer is asked for under the grammar; without one, the text
    is the answer (as before). With the lazy grammar on, the value-or-calls rule holds such prose back
    (a scripted member only follows its script, so the mask would garble it); off, the prose is written,
    as it is wherever text leaves the rule, and the answer turn catches it."""
    from ensemble_core.constraints.structured import reply_content
    from ensemble_core.serving.runtime import Run, settle

    schema = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}
    history = [{"role": "user", "content": "6 times 7?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    for response_format, text in [(schema, '{"value": 42}'), (None, "Let me check that again.")]:
        ensemble = Ensemble([scripted_member(SMOL, prose_then_repeat, f"prose-repeat-{bool(response_format)}")],
                            method="single")
        run = Run(ensemble, history, {"tools": TOOLS, "response_format": response_format, "max_new_tokens": 60,
                                      "lazy_tool_grammar": False})
        for _ in run:
            pass
        result = settle(run)
        assert result.structured.repeated_tool_calls and not result.structured.tool_calls
        assert reply_content(result.text, result.structured).strip() == text  # the message's text
        if response_format:
            assert result.parsed == {"value": 42} and result.structured.parse_error is None


def prose_then_json(prompt: str) -> str:
    """A member that answers in prose where a JSON value was asked for, and writes it in the answer turn."""
    return '{"value": 42}' if ANSWER_REQUEST in prompt else "6 times 7 is 42."


@pytest.mark.parametrize("stream", [False, True])
def test_a_direct_answer_that_breaks_the_response_format_is_answered_again_under_it(stream: bool) -> None:
    """Tools offered in ``auto`` and a ``response_format``: a reply that neither calls nor is a value of the
    schema (written with the lazy grammar off, or committed where text left its rule) is answered in a turn
    of its own under the schema's grammar, streamed or not; its prose is never shown (content is held back
    whole when a schema is asked for)."""
    schema = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}
    chat = ChatEnsemble(members=[scripted_member(SMOL, prose_then_json, f"prose-{stream}")], method="single",
                        max_tokens=40)
    bound = chat.bind_tools([multiply], response_format={"type": "json_schema", "json_schema": {"name": "P", "schema": schema}},
                            lazy_tool_grammar=False)
    history = [HumanMessage("6 times 7?"), AIMessage(content="", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7},
                                                                              "id": "c1"}]),
               ToolMessage(content="42", tool_call_id="c1")]
    if stream:
        chunks = list(bound.stream(history))
        assert all("6 times 7" not in str(c.content) for c in chunks)
        message = functools.reduce(operator.add, chunks)
    else:
        message = bound.invoke(history)
    assert message.content == '{"value": 42}' and not message.tool_calls
    direct = ChatEnsemble(members=[scripted_member(SMOL, prose_then_json, f"prose-free-{stream}")], method="single",
                          max_tokens=40).bind_tools([multiply]).invoke(history)
    assert direct.content == "6 times 7 is 42."  # without a response_format, prose is the answer


class SecondChoiceLM(ScriptedLM):
    """A scripted LM with a runner-up: at each position of its reply the scripted token scores 0, the token of
    ``second(prompt)`` at the same position -5 and every other token -1e4, so a mask that forbids the first
    choice gets the second (as a real member ranks the value below the prose it would write)."""

    def __init__(self, inner: Any, tokenizer: Any, reply: Any, second: Any) -> None:
        super().__init__(inner, tokenizer, reply)
        self.second, self._second_of, self._second_ids = second, None, []

    def forward(self, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
        out = super().forward(input_ids, cache=cache, **kwargs)
        if self._second_of != self.prompts[-1]:
            self._second_of = self.prompts[-1]
            self._second_ids = [*self.tokenizer(self.second(self._second_of), add_special_tokens=False)["input_ids"],
                                self.tokenizer.eos_token_id]
        rows = out.logits.shape[1]
        for r in range(rows):
            produced = len(self._ids) - rows + r + 1 - self._prompt_len
            token = self._second_ids[min(max(produced, 0), len(self._second_ids) - 1)]
            out.logits[0, r, token] = max(float(out.logits[0, r, token]), -5.0)
        return out


PROSE = "Six times seven gives forty two"


def second_choice_member(alias: str, name: str, reply: Any = PROSE, second: Any = '{"value": 42}') -> Member:
    base = tiny_member(alias, seed=1)
    lm = SecondChoiceLM(base.model, base.tokenizer, reply if callable(reply) else (lambda prompt: reply),
                        second if callable(second) else (lambda prompt: second))
    return Member(lm, base.tokenizer, name=name, prefix_cache=0)  # ScriptedLM tells requests apart by an empty cache


HISTORY = [{"role": "user", "content": "6 times 7?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "42"}]


@pytest.mark.parametrize("method", ["single", "safe", "every-token", "specem", "generate-then-select"])
def test_a_member_that_would_answer_in_prose_writes_the_value_in_the_same_turn(method: str) -> None:
    """Tools in ``auto`` and a ``response_format``: members whose first choice is prose and second the value
    write the value in their reply, under every method: no answer turn (each member read one prompt)."""
    members = [second_choice_member(SMOL, f"second-smol-{method}")]
    if method != "single":
        members.append(second_choice_member(QWEN, f"second-qwen-{method}"))
    ensemble = Ensemble(members, method=method)
    from ensemble_core.serving.runtime import Run, settle

    run = Run(ensemble, HISTORY, {"tools": TOOLS, "response_format": VALUE, "max_new_tokens": 40})
    for _ in run:
        pass
    result = settle(run)
    assert result.text == '{"value": 42}' and result.parsed == {"value": 42}, result.text
    assert not result.tool_calls and all(len(m.model.prompts) == 1 for m in members)
    free = ensemble.generate(HISTORY, tools=TOOLS, max_new_tokens=40)
    assert free.text == PROSE  # without a response_format, prose is the answer


def call_then_prose(prompt: str) -> str:
    """Call the tool; once its result (42.0) follows the question, answer in prose."""
    return PROSE if "42" in prompt.split("6 times 7?", 1)[-1] else CALL


@pytest.mark.parametrize("stream", [False, True])
def test_create_agent_reads_the_value_written_in_the_turn_after_the_tool(stream: bool) -> None:
    """LangChain's ``create_agent(..., response_format=Model)``: the call, the tool, then the reply is the
    model's value, written where the member would have answered in prose: two model calls, no third."""
    from langchain.agents import create_agent
    from pydantic import BaseModel, ConfigDict

    class Product(BaseModel):
        model_config = ConfigDict(extra="forbid")
        value: float

    member_ = second_choice_member(SMOL, f"second-agent-{stream}", reply=call_then_prose)
    chat = ChatEnsemble(members=[member_], method="single", max_tokens=40)
    agent = create_agent(chat, [multiply], response_format=Product)
    question = {"messages": [HumanMessage("6 times 7?")]}
    if stream:
        *_, state = agent.stream(question, {"recursion_limit": 6}, stream_mode="values")
    else:
        state = agent.invoke(question, {"recursion_limit": 6})
    assert state["structured_response"] == Product(value=42)
    assert [type(m).__name__ for m in state["messages"]] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert len(member_.model.prompts) == 2


def test_streamed_repeat_is_broken_and_the_answer_streams_as_text() -> None:
    chat = ChatEnsemble(members=[scripted_member(SMOL, repeater, "repeater-stream")], method="single", max_tokens=64)
    history = [HumanMessage("6 times 7?"), AIMessage(content="", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7},
                                                                              "id": "c1"}]),
               ToolMessage(content="42", tool_call_id="c1")]
    chunks = list(chat.bind_tools([multiply]).stream(history))
    merged = functools.reduce(operator.add, chunks)
    assert merged.content == "6 times 7 is 42." and merged.tool_calls == []  # the repeat's pieces end in break text
    assert sum(bool(c.content) for c in chunks) > 1  # the answer was streamed


async def test_function_agent_finishes_when_the_member_repeats_its_call() -> None:
    log: list[tuple[float, float]] = []

    def times(a: float, b: float) -> float:
        """Multiply two numbers."""
        log.append((a, b))
        return a * b

    llm = EnsembleLLM(members=[scripted_member(SMOL, repeater, "li-repeater")], method="single", max_new_tokens=64)
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(times, name="multiply")], llm=llm)  # streaming, as default
    answer = await agent.run("What is 6 times 7?", max_iterations=4)
    assert log == [(6, 7)] and str(answer) == "6 times 7 is 42."


# ----------------------------------------------------------------------------- streaming
def test_reply_stream_sends_call_pieces_and_breaks_a_call_that_does_not_parse() -> None:
    request = structured_request(TOOLS)
    stream = ReplyStream.for_request(request)
    text = 'Sure.\n<tool_call>\n{"name": "capital", "arguments": {"country": "Peru"}}\n</tool_call>'
    shown, pieces = "", []
    for i in range(0, len(text), 4):
        piece, calls = stream.feed(text[i:i + 4])
        shown += piece
        pieces += calls
    assert shown == "Sure." and pieces[0] == CallDelta(0, pieces[0].id, "capital", "")
    assert "".join(p.arguments for p in pieces) == '{"country": "Peru"}' and len(pieces) > 3
    output = parse_output(text, request)
    assert stream.finish(output) == [] and output.tool_calls[0].id == pieces[0].id  # the ids agree
    cut = ReplyStream.for_request(request)
    _, calls = cut.feed('{"name": "capital", "arguments": {"country": "Pe')
    closing = cut.finish(parse_output('{"name": "capital", "arguments": {"country": "Pe', request))
    chunks = [AIMessageChunk(content="", tool_call_chunks=[
        {"name": c.name, "args": c.arguments or None, "id": c.id, "index": c.index, "type": "tool_call_chunk"}])
        for c in [*calls, *closing]]
    merged = functools.reduce(operator.add, chunks)
    assert merged.tool_calls == [] and merged.invalid_tool_calls[0]["name"] == "capital"  # never completed into a call


def test_server_streams_tool_call_deltas_while_decoding() -> None:
    from fastapi.testclient import TestClient
    from test_server import sse_events

    from ensemble_core.server import create_app

    m = scripted_member(SMOL, "Let me see.\n" + CALL, "streamer")
    with TestClient(create_app(ensemble=Ensemble([m], method="single", max_new_tokens=64))) as tc:
        body = {"messages": [{"role": "user", "content": "6 times 7?"}], "tools": TOOLS, "stream": True}
        with tc.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me see."
    assert calls[0]["function"]["name"] == "multiply" and calls[0]["id"] and calls[0]["type"] == "function"
    assert len(calls) > 2 and json.loads("".join(c["function"]["arguments"] for c in calls)) == {"a": 6, "b": 7}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


TWO_CALLS = CALL + '\n{"name": "capital", "arguments": {"country": "Peru"}}'


def test_parallel_tool_calls_false_ends_the_reply_after_its_first_call() -> None:
    """OpenAI's ``parallel_tool_calls=False`` (LangChain's ``bind_tools(..., parallel_tool_calls=False)``, the
    server's field, LlamaIndex's ``allow_parallel_tool_calls``): at most one call. It raised in LangChain
    (an unknown option) and the server ignored it."""
    from fastapi.testclient import TestClient

    from ensemble_core.server import create_app

    p = TokenPipeline(GenerationConfig(), calls=LazyCalls((MULTIPLY, CAPITAL), single=True).start(member(SMOL), budget=64))
    p.commit(CALL)
    assert p.calls.ended and allowed(p).nonzero().flatten().tolist() == sorted(member(SMOL).eos_token_ids)
    ensemble = Ensemble([scripted_member(SMOL, TWO_CALLS, "two-calls")], method="single", max_new_tokens=64)
    assert [c.name for c in ensemble.generate("6 times 7?", tools=TOOLS).tool_calls] == ["multiply", "capital"]
    one = ensemble.generate("6 times 7?", tools=TOOLS, parallel_tool_calls=False)
    assert [c.name for c in one.tool_calls] == ["multiply"] and one.text == CALL and one.finish_reason != "length"
    free = ensemble.generate("6 times 7?", tools=TOOLS, parallel_tool_calls=False, lazy_tool_grammar=False)
    assert free.text == TWO_CALLS and [c.name for c in free.tool_calls] == ["multiply"]  # read: the first call
    with pytest.raises(InvalidOptionError, match="parallel_tool_calls"):
        ensemble.generate("6 times 7?", tools=TOOLS, parallel_tool_calls="no")
    chat = ChatEnsemble(ensemble=ensemble)
    assert len(chat.bind_tools(TOOLS).invoke("6 times 7?").tool_calls) == 2
    assert [c["name"] for c in chat.bind_tools(TOOLS, parallel_tool_calls=False).invoke("6 times 7?").tool_calls] == [
        "multiply"]
    llm = EnsembleLLM(members=ensemble.members, method="single", max_new_tokens=64)
    tools = [FunctionTool.from_defaults(fn=lambda a, b: a * b, name="multiply", description="Multiply."),
             FunctionTool.from_defaults(fn=lambda country: "", name="capital", description="A capital.")]
    for allow, names in ((True, ["multiply", "capital"]), (False, ["multiply"])):
        reply = llm.chat_with_tools(tools, "6 times 7?", allow_parallel_tool_calls=allow)
        assert [c.tool_name for c in llm.get_tool_calls_from_response(reply)] == names
    with TestClient(create_app(ensemble=ensemble)) as tc:
        body = {"messages": [{"role": "user", "content": "6 times 7?"}], "tools": TOOLS}
        for parallel, n in ((None, 2), (True, 2), (False, 1)):
            sent = body if parallel is None else {**body, "parallel_tool_calls": parallel}
            assert len(tc.post("/v1/chat/completions", json=sent).json()["choices"][0]["message"]["tool_calls"]) == n
        bad = tc.post("/v1/chat/completions", json={**body, "ensemble": {"parallel_tool_calls": False}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ensemble.parallel_tool_calls"


# ----------------------------------------------------------------------------- LlamaIndex contract
def test_llamaindex_never_passes_an_invalid_call_off_as_an_answer() -> None:
    llm = EnsembleLLM(members=[scripted_member(SMOL, "hi", "li-contract")], method="single", max_new_tokens=8)
    output = parse_output('{"name": "multiply", "arguments": {"a": 6', structured_request(TOOLS))
    response = ChatResponse(message=assistant_message(output.content, output), additional_kwargs={"finish_reason": "length"})
    with pytest.raises(ValueError, match="multiply.*cannot run.*budget"):
        llm.get_tool_calls_from_response(response)
    selection = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    assert [s.tool_name for s in selection] == [INVALID_CALL] and selection[0].tool_kwargs["name"] == "multiply"
    history = to_core_messages([ChatMessage(role="user", content="6 times 7?"), response.message,
                                ChatMessage(role="tool", content="Tool invalid_tool_call not found.",
                                            additional_kwargs={"tool_call_id": selection[0].tool_id})])
    assert [m["role"] for m in history] == ["user", "assistant", "user"] and "tool_calls" not in history[1]
    assert history[2]["content"].startswith("Your call of multiply could not run: the call is not valid JSON")


async def test_function_agent_asks_again_after_an_invalid_call() -> None:
    log: list[tuple[float, float]] = []

    def times(a: float, b: float) -> float:
        """Multiply two numbers."""
        log.append((a, b))
        return a * b

    def reply(prompt: str) -> str:
        if "42" in prompt:
            return "6 times 7 is 42."
        return CALL if "could not run" in prompt else '{"name": "multiply", "arguments": {"a": 6}}'

    llm = EnsembleLLM(members=[scripted_member(SMOL, reply, "li-retry")], method="single", max_new_tokens=48,
                      lazy_tool_grammar=False)  # free decoding, so that the member's invalid call stays invalid
    agent = FunctionAgent(tools=[FunctionTool.from_defaults(times, name="multiply")], llm=llm)
    answer = await agent.run("What is 6 times 7?", max_iterations=6)
    assert log == [(6, 7)] and str(answer) == "6 times 7 is 42."



# ----------------------------------------------------------------------------- one decision, many spellings
def test_call_openers_in_any_spelling_are_one_decision_at_an_ensemble_point() -> None:
    """Measured at the first token of "Who wrote the book Dune?" (SAFE, Qwen drafting, SmolLM2 verifying,
    the prior's weights): Qwen put 0.26 on ``{"`` and 0.08 on ``{`` + newline, 0.20 on ``The``; fused
    separately the call lost (0.20) to ``The`` (0.22) and the ensemble answered without the tool Qwen
    alone calls. As one decision the call carries Qwen's 0.34 (a spelling that is a prefix of another
    is not added twice), and text before a call, a call in progress or ``"none"`` merge nothing."""
    from ensemble_core.text.distributions import Candidates, EndOfText

    keys = (b'{"', b"The", b"{\n", b"{", b"D", EndOfText())
    member_probs = torch.tensor([[0.26, 0.20, 0.08, 0.30, 0.00, 0.01],   # Qwen ("{" includes both spellings)
                                 [0.00, 0.31, 0.00, 0.00, 0.40, 0.02]])  # SmolLM2
    weights = torch.tensor([0.77, 0.23])
    fused = (weights[:, None] * member_probs).sum(0)
    candidates = Candidates(keys, member_probs, fused, torch.ones(len(keys), dtype=torch.bool), weights)
    p = pipeline(SMOL)
    plain = [None if isinstance(k, EndOfText) else k for k in keys]
    assert p.calls.call_openers("", plain) == [0, 2, 3]
    merged = p.merged_call_openers(candidates)
    assert merged.keys == (b"The", b"{", b"D", EndOfText())  # the most favoured spelling carries the call
    assert merged.member_probs[0, 1].item() == pytest.approx(0.34)  # {" + {\n; "{" is their prefix: not added
    assert merged.fused[1].item() == pytest.approx(0.77 * 0.34) and merged.fused.argmax().item() == 1
    # UniTE's sub_tokens="once" (the default): each token backs one candidate, so every spelling adds
    exclusive = Candidates(keys, member_probs, fused, torch.ones(len(keys), dtype=torch.bool), weights, exclusive=True)
    assert p.merged_call_openers(exclusive).member_probs[0, 1].item() == pytest.approx(0.64)
    assert p.calls.call_openers("Sure, ", plain) == []  # mid-line: "{" is not a call opener
    assert p.calls.call_openers("Sure.\n", plain) == [0, 2, 3]  # a new line: it is
    assert pipeline(SMOL, forbid=True).calls.call_openers("", plain) == []  # "none": nothing to merge
    busy = pipeline(SMOL)
    busy.commit("<tool_call>\n")  # a call in progress: its grammar decides
    assert busy.calls.call_openers("", plain) == []


def test_following_free_text_rescans_only_its_tail() -> None:
    """A reply's free text is scanned for triggers once: after a long answer the next scan starts at most
    TRIGGER_SPAN bytes back (not at the start, on every token), and a call after it still activates."""
    from ensemble_core.constraints.triggers import TRIGGER_SPAN

    p = pipeline(QWEN)
    for _ in range(50):
        p.commit("The answer is in the text above. ")
    assert p.calls.scan >= len(p.calls.text) - TRIGGER_SPAN > 1000
    p.commit("\n<tool_call>\n")
    assert p.calls.active is not None and p.calls.activations == 1


# ----------------------------------------------------------------------------- checked up front
def test_auto_refuses_what_required_refuses_before_any_text_and_checks_each_tool_set_once(monkeypatch) -> None:
    from ensemble_core.constraints import grammar
    from ensemble_core.errors import UnsupportedSchemaFeatureError

    ensemble = Ensemble([member(SMOL)], method="single")
    bad = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    for choice in ("auto", "required"):
        with pytest.raises(UnsupportedSchemaFeatureError, match="tool 'pick' parameters"):
            ensemble.generate("hi", tools=[bad], tool_choice=choice, max_new_tokens=2)
    stream = ensemble.stream("hi", tools=[bad], max_new_tokens=2)  # auto: refused before the first delta
    with pytest.raises(UnsupportedSchemaFeatureError):
        next(iter(stream))
    compiles = []
    real = grammar._check_grammar
    monkeypatch.setattr(grammar, "_check_grammar", lambda schema: compiles.append(schema) or real(schema))
    fresh = {"type": "function", "function": {"name": "upfront_once", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}
    for _ in range(3):  # an agent's turns: the tool set is compiled on the first one only
        ensemble.generate("hi", tools=[fresh], max_new_tokens=1)
    assert len(compiles) == 1
