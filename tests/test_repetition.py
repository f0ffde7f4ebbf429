"""The loop penalty (``ensemble_core.constraints.repetition``): constrained output that repeats itself ends.

The rule is checked as a pure function on bytes, inside a member's grammar state (its own
token space, real tokenizers), and end to end: members biased to write an endless list of
empty strings (a loop the grammar allows forever) run into the token budget without the
penalty and close the value with it, for every method.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'")

from test_agents import METHODS, biased_member  # noqa: E402

from ensemble_core import Ensemble  # noqa: E402
from ensemble_core.constraints.closing import closes_only, closing_bonus, closing_factors, in_string, resolve_margin  # noqa: E402
from ensemble_core.constraints.grammar import JsonConstraint, compile_constraint  # noqa: E402
from ensemble_core.constraints.repetition import LoopPenalty, loop_penalties, text_factors  # noqa: E402
from ensemble_core.decoding.generation import GenerationConfig  # noqa: E402
from ensemble_core.errors import InvalidOptionError  # noqa: E402
from ensemble_core.testing import bundled_tokenizer  # noqa: E402

RULE = LoopPenalty()
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
        "required": ["tags"], "additionalProperties": False}


# ----------------------------------------------------------------------------- the rule on bytes
def test_a_repeat_penalizes_the_byte_that_continues_it_and_grows() -> None:
    item = b', "L\xc3\xa9a"'  # 7 bytes without the space (whitespace is not seen)
    short = b'{"tags": ["L\xc3\xa9a"' + item * 2  # 13 repeated bytes: free
    assert loop_penalties(short, RULE) == {}
    penalties = [loop_penalties(b'{"tags": ["L\xc3\xa9a"' + item * k, RULE) for k in (4, 5, 6)]
    assert all(set(p) == {ord(",")} for p in penalties)
    values = [p[ord(",")] for p in penalties]
    assert values[0] >= RULE.multiplier and values[0] < values[1] < values[2]
    # one more unit (7 bytes) multiplies the penalty by base ** (7 / 4)
    assert values[1] / values[0] == pytest.approx(RULE.base ** (7 / RULE.bytes_per_step))
    # a digit run: the next same digit is penalized, nothing else
    assert set(loop_penalties(b'{"x": 0.' + b"3" * 40, RULE)) == {ord("3")}


def test_keys_between_different_values_and_whitespace() -> None:
    # consecutive objects repeat their keys, but a different value breaks the run: no penalty
    items = b'[{"sku": "A-1", "quantity": 4, "price": 2.5}, {"sku": "A-2", "quantity": '
    assert loop_penalties(items, RULE) == {}
    # changing the indentation does not escape a repeat (JSON whitespace is not seen)
    flat = b'{"tags": ["ab"' + b', "ab"' * 6
    pretty = b'{"tags": [\n  "ab"' + b',\n    "ab"' * 3 + b', "ab"' * 3
    assert loop_penalties(pretty, RULE) == loop_penalties(flat, RULE) != {}
    assert loop_penalties(flat, LoopPenalty(multiplier=0)) == {}


def test_text_factors_down_weight_candidates_by_their_first_visible_byte() -> None:
    factors = text_factors({ord(","): 2.0}, [b",", b' , "x"', b"]", None, b""])
    assert factors.tolist() == pytest.approx([float(torch.exp(torch.tensor(-2.0)))] * 2 + [1.0, 1.0, 1.0])


@pytest.mark.parametrize("bad", [{"multiplier": -1}, {"multiplier": True}, {"base": 0.5}, {"allowed": 0},
                                 {"max_period": 200}])
def test_bad_rules_are_typed_errors(bad: dict) -> None:
    with pytest.raises(InvalidOptionError):
        LoopPenalty(**bad)


def test_loop_penalty_option_is_validated() -> None:
    assert GenerationConfig().loop_penalty == 1.0
    for bad in (-0.5, "1", None):
        with pytest.raises(InvalidOptionError, match="loop_penalty"):
            GenerationConfig(loop_penalty=bad)


# ----------------------------------------------------------------------------- in a member's token space
@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_grammar_state_penalizes_only_tokens_that_continue_the_repeat(alias: str) -> None:
    tokenizer = bundled_tokenizer(alias)
    compiled = compile_constraint(JsonConstraint(TAGS), tokenizer, len(tokenizer))
    state = compiled.start()
    assert state.accept_text('{"tags": ["ab"' + ', "ab"' * 3)
    assert state.penalty() is None  # 14 repeated bytes: free
    mark, plain = state.checkpoint(), state.mask_logits(torch.zeros(state.vocab_size))
    assert state.accept_text(', "ab"' * 3)
    logits = state.mask_logits(torch.zeros(state.vocab_size))
    # the grammar's choice is unchanged (same finite entries); only tokens starting with "," lose
    assert torch.equal(torch.isfinite(logits), state.allowed())
    comma, close = (tokenizer.encode(t, add_special_tokens=False)[0] for t in (",", "]"))
    assert logits[comma] < -1.0 and logits[close] == 0.0
    assert state.text.endswith(b', "ab"')
    state.restore(mark)  # rolled back with the grammar position
    assert state.penalty() is None and torch.equal(state.mask_logits(torch.zeros(state.vocab_size)), plain)
    off = compiled.start(LoopPenalty(multiplier=0))
    assert off.accept_text('{"tags": ["ab"' + ', "ab"' * 6) and off.penalty() is None


# ----------------------------------------------------------------------------- end to end, every method
def looping_bias(raw: bytes, special: bool) -> float:
    """Compact JSON that closes every string at once and always wants one more list item.

    The closing quote is far ahead of anything else (+20), so the penalty ends the list
    (``]`` against ``,``: +6) before it could open the string (a ``,`` inside it: +6).
    """
    if special or not raw:
        return 0.0
    if raw.isspace():
        return -30.0
    if raw == b'"':
        return 20.0
    if raw == b",":
        return 6.0
    return -5.0 if raw[:1] in (b'"', b",") else 0.0  # no merged '",' or '""' tokens


@pytest.fixture(scope="module")
def looping_pair() -> list:
    return [biased_member("smollm2-135m-instruct", looping_bias, name="looping-smollm2"),
            biased_member("gemma3-270m", looping_bias, name="looping-gemma3")]


@pytest.mark.parametrize("method", METHODS)
def test_a_looping_list_ends_with_the_penalty_and_not_without(looping_pair: list, method: str) -> None:
    ensemble = Ensemble(looping_pair, method=method, close_margin=0)  # the loop penalty alone
    cut = ensemble.generate("Tags?", response_format=TAGS, max_new_tokens=96, loop_penalty=0)
    assert cut.finish_reason == "length" and cut.text.count('""') > 20, cut.text
    done = ensemble.generate("Tags?", response_format=TAGS, max_new_tokens=96)
    assert done.finish_reason == "eos", done.text
    tags = json.loads(done.text)["tags"]
    assert 8 <= len(tags) < cut.text.count('""') and set(tags) == {""}


def test_the_option_reaches_the_langchain_adapter(looping_pair: list) -> None:
    from langchain_core.exceptions import OutputParserException
    from langchain_ensemble import ChatEnsemble
    from pydantic import BaseModel

    class Tags(BaseModel):
        tags: list[str]

    # uniform votes (reliability="none"): the bias above is tuned for the published average of the two members
    parsed = ChatEnsemble(members=looping_pair, method="every-token", max_tokens=96,
                          reliability="none").with_structured_output(Tags)
    assert 8 <= len(parsed.invoke("Tags?").tags) < 20
    off = ChatEnsemble(members=looping_pair, method="every-token", max_tokens=96, loop_penalty=0,
                       close_margin=0, reliability="none")
    with pytest.raises(OutputParserException, match="token budget"):
        off.with_structured_output(Tags).invoke("Tags?")


# ----------------------------------------------------------------------------- SAFE's ensemble points
NUMBERS = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}}},
           "required": ["n"], "additionalProperties": False}


def ones_bias(comma: float) -> Any:
    """Compact JSON that writes ``1`` for every item and wants ``,`` after it by ``comma`` logits over ``]``."""
    def bias(raw: bytes, special: bool) -> float:
        if special or not raw:
            return 0.0
        if raw.isspace():
            return -30.0
        if raw == b"1":
            return 20.0
        if raw == b",":
            return comma
        return -5.0 if raw[:1] in (b",", b"1") or raw[-1:] in (b",", b"1") else 0.0  # no merged "1," / ",1"
    return bias


def test_safe_ensemble_points_penalize_a_repeat_the_verifier_would_continue() -> None:
    """The drafter decodes under the penalty and proposes ``]``; the verifier (+30 for ``,``,
    scoring without the grammar's penalty) disagrees at every ``1,`` / ``1]`` point, a
    boundary of both tokenizers. The fused ``,`` must be penalized there too, or the
    verifier's vote keeps the list going to the token budget (checked: without the
    reweighting in ``SafeEnsemble._ensemble`` this run ends by length)."""
    drafter = biased_member("smollm2-135m-instruct", ones_bias(6.0), name="looping-drafter")
    verifier = biased_member("gemma3-270m", ones_bias(30.0), name="item-loving-verifier")
    ensemble = Ensemble([drafter, verifier], method="safe", close_margin=0)  # the loop penalty alone
    cut = ensemble.generate("Numbers?", response_format=NUMBERS, max_new_tokens=96, loop_penalty=0)
    assert cut.finish_reason == "length", cut.text
    done = ensemble.generate("Numbers?", response_format=NUMBERS, max_new_tokens=96)
    assert done.finish_reason == "eos" and done.stats["ensembled"] > 0, done.text
    items = json.loads(done.text)["n"]
    assert set(items) == {1} and 8 <= len(items) < cut.text.count("1,")



# ----------------------------------------------------------------------------- closing pressure
def test_closing_bonus_grows_towards_the_end_of_the_budget() -> None:
    assert closing_bonus(None, 24) == closing_bonus(25, 24) == closing_bonus(3, 0) == 0.0
    assert [closing_bonus(left, 24) for left in (24, 21, 12, 0, -2)] == [1.0, 2.0, 16.0, 256.0, 256.0]
    # only tokens that close: '",' closes a string and starts the next item; inside a string
    # only a quote closes, outside one a quote opens
    texts = (b'"', b'"]}', b"]", b" ]}", b"\n}", b'",', b', "', b"a", b" ", b"", None)
    assert [closes_only(t, inside=True) for t in texts] == [True, True] + [False] * 9
    assert [closes_only(t, inside=False) for t in texts] == [False, False, True, True, True] + [False] * 6
    assert [in_string(t) for t in (b'{"a', b'{"a": "x\\"', b'{"a": "x\\\\"', b'["a", "b"]')] == [True, True, False, False]
    assert closing_factors(2.0, [b"]", b'",', None, b"\n  "], inside=False).tolist() == pytest.approx(
        [math.exp(2.0), 1.0, 1.0, math.exp(-2.0)])  # blank text loses what closing text gains
    for bad in (-1, 2.5, True, "24"):
        with pytest.raises(InvalidOptionError, match="close_margin"):
            GenerationConfig(close_margin=bad)
    assert GenerationConfig().close_margin is None  # automatic: a quarter of the budget, at least 24
    assert [resolve_margin(None, n) for n in (40, 96, 160, 256)] == [24, 24, 40, 64] and resolve_margin(0, 160) == 0


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_grammar_state_boosts_closing_tokens_near_the_budget(alias: str) -> None:
    tokenizer = bundled_tokenizer(alias)
    state = compile_constraint(JsonConstraint(TAGS), tokenizer, len(tokenizer)).start(LoopPenalty(multiplier=0), 24)
    assert state.accept_text('{"tags": ["red", "blue"')
    assert state.penalty() is None  # never told a budget: no pressure
    state.set_budget(30)
    assert state.budget_left == 30 and state.penalty() is None  # outside the margin
    comma, close = tokenizer.convert_tokens_to_ids(","), tokenizer.convert_tokens_to_ids("]")
    state.set_budget(12)
    vec = state.penalty()
    assert vec is not None and float(vec[close]) == -16.0 and float(vec[comma]) == 0.0
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and float(vec[newline[0]]) == 16.0  # whitespace would only delay the end
    merged = tokenizer.encode('",', add_special_tokens=False)
    if len(merged) == 1:  # a close-and-go-on token gains nothing
        assert float(vec[merged[0]]) == 0.0
    step = state.steps
    assert state.accept_token(comma)  # one more token: one fewer left
    assert state.steps == step + 1 and state.budget_left == 11 and float(state.penalty()[close]) < -16.0
    row = torch.zeros(state.vocab_size)
    masked = state.mask_logits(row)
    assert float(masked[close]) == float("-inf")  # after ',' the grammar wants an item: the bonus never unmasks
    assert state.accept_text(' "gr')  # inside a string: ']' is a character there, only a quote closes
    vec, quote = state.penalty(), tokenizer.encode('"', add_special_tokens=False)
    assert len(quote) == 1 and float(vec[close]) == 0.0 and float(vec[quote[0]]) < -16.0


@pytest.mark.parametrize("method", METHODS)
def test_a_list_that_never_ends_closes_before_the_budget(looping_pair: list, method: str) -> None:
    """Loop penalty off, so nothing but the closing pressure ends the list."""
    free = Ensemble(looping_pair, method=method, loop_penalty=0, close_margin=0)
    cut = free.generate("Tags?", response_format=TAGS, max_new_tokens=64)
    assert cut.finish_reason == "length", cut.text
    done = Ensemble(looping_pair, method=method, loop_penalty=0).generate("Tags?", response_format=TAGS,
                                                                          max_new_tokens=64)
    assert done.finish_reason == "eos", done.text
    tags = json.loads(done.text)["tags"]
    assert set(tags) == {""} and len(tags) >= 5  # it wrote most of the budget before closing
