"""Constrained decoding (``ensemble_core.constraints.grammar``): outputs always parse and validate, per tokenizer.

Random-logit sampling under the mask is the adversary: whatever the logits, every output
must decode (with the project's decode flags) to JSON that validates against the schema.
Only tokenizers and tiny random-weight members are used, so the module stays fast.
"""

from __future__ import annotations

import functools
import json
import sys

import jsonschema
import pytest
import torch

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance: pip install 'llguidance>=1.9,<2'")

from ensemble_core.constraints.grammar import (
    MAX_SAFE_INTEGER,
    ConstraintState,
    JsonConstraint,
    bounded_integers,
    call_format_constraint,
    compile_constraint,
    compile_for_member,
    token_table,
    tool_call_constraint,
)
from ensemble_core.errors import (
    ConstraintError,
    InputError,
    InvalidSchemaError,
    MissingDependencyError,
    UnknownToolError,
    UnsupportedSchemaFeatureError,
)
from ensemble_core.testing import bundled_tokenizer, tiny_member  # noqa: E402
from ensemble_core.text.alignment import IncrementalDecoder, decode, tokenize  # noqa: E402

# Qwen2.5-Coder's tokenizer (151k byte-level BPE, the same decoder kind as SmolLM2's) is not in
# this list, to keep the module fast; a grammar state on it is tested in tests/test_repetition.py
# (the loop-penalty test runs on all three tokenizers). Checked by hand on the
# GGUF-converted Qwen tokenizer: its 271 "[PAD151665]"... rows are plain vocabulary entries (they
# decode to that text), so they are allowed inside strings like any text.
TOKENIZERS = ["smollm2-135m-instruct", "gemma3-270m"]
SEEDS = range(20)

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "color": {"enum": ["red", "grün", "青", "✓ ok"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{4,5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}}},
    {"name": "send_email", "description": "bare function dict", "parameters": {
        "type": "object",
        "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                       "cc": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
        "required": ["to", "subject"]}},
]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest):
    return bundled_tokenizer(request.param)


def vocab(tokenizer) -> int:
    return len(tokenizer) + 64  # padded model rows, as many real models have


@functools.cache
def _preferences(tokenizer, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens made only of closing characters, and tokens without whitespace (to make sampling end)."""
    tokens, _ = token_table(tokenizer)
    pad = [False] * (v - len(tokens))
    closing = [bool(b) and not b.strip(b'"}]') for b in tokens] + pad
    no_ws = [bool(b) and b.split() == [b] for b in tokens] + pad
    return torch.tensor(closing), torch.tensor(no_ws)


def sample(state: ConstraintState, tokenizer, seed: int, budget: int = 30, cap: int = 400) -> list[int]:
    """Random logits under the mask; after ``budget`` tokens prefer tokens that close the value.

    Checks at every step that the mask is never empty and allows EOS exactly when ``can_end``.
    Returns the ids without the final EOS.
    """
    gen = torch.Generator().manual_seed(seed)
    eos = sorted(state.compiled.eos_token_ids)
    closing, no_ws = _preferences(tokenizer, state.vocab_size)
    ids: list[int] = []
    for step in range(cap):
        masked = state.mask_logits(torch.randn(state.vocab_size, generator=gen))
        allowed = state.allowed()
        assert allowed.any()
        assert bool(allowed[eos].any()) == state.can_end
        if step < 2:
            assert torch.equal(torch.isfinite(masked), allowed)
        if step >= budget:
            if state.can_end:
                assert state.accept_token(eos[0]) and state.finished
                return ids
            for pref in (closing, no_ws):
                if (allowed & pref).any():
                    masked = masked.masked_fill(~pref, float("-inf"))
                    break
        elif state.can_end and int(allowed.sum()) > len(eos):
            masked[eos] = float("-inf")  # keep going until the budget
        token = int(masked.argmax())
        assert state.accept_token(token)
        if token in eos:
            assert state.finished
            return ids
        ids.append(token)
    raise AssertionError(f"no EOS within {cap} tokens: {decode(tokenizer, ids)!r}")


def check_output(tokenizer, ids: list[int], constraint: JsonConstraint) -> object:
    text = decode(tokenizer, ids)
    value = json.loads(text)
    jsonschema.validate(value, constraint.schema or {"type": "object"})
    # the decoded text is exactly what the grammar saw: replaying it as text completes the value
    replay = compile_constraint(constraint, tokenizer, vocab(tokenizer)).start()
    assert replay.accept_text(text) and replay.can_end
    return value


# ----------------------------------------------------------------------------- always valid
@pytest.mark.parametrize("kind", ["nested", "tool_call", "json_object"])
def test_random_sampling_always_validates(tokenizer, kind: str) -> None:
    constraint = {"nested": JsonConstraint(NESTED), "tool_call": tool_call_constraint(TOOLS, None),
                  "json_object": JsonConstraint()}[kind]
    compiled = compile_constraint(constraint, tokenizer, vocab(tokenizer))
    names = set()
    for seed in SEEDS:
        value = check_output(tokenizer, sample(compiled.start(), tokenizer, seed), constraint)
        assert isinstance(value, dict)
        if kind == "tool_call":
            names.add(value["name"])
            assert list(value) == ["name", "arguments"]  # the name first, so it fixes the arguments' schema
    if kind == "tool_call":
        assert len(names) >= 2  # random logits reach more than one tool


def test_tool_choice_forces_that_tool(tokenizer) -> None:
    constraint = tool_call_constraint(TOOLS, "search_web")
    compiled = compile_constraint(constraint, tokenizer, vocab(tokenizer))
    for seed in range(5):
        value = check_output(tokenizer, sample(compiled.start(), tokenizer, seed), constraint)
        assert value["name"] == "search_web" and set(value["arguments"]) <= {"query", "max_results"}
    same = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "search_web"}})
    assert same == constraint and hash(same) == hash(constraint)
    assert tool_call_constraint(TOOLS, "required") == tool_call_constraint(TOOLS, "any") == tool_call_constraint(TOOLS)


# ----------------------------------------------------------------------------- operations
def test_accept_text_mid_token_then_mask_continues(tokenizer) -> None:
    compiled = compile_constraint(tool_call_constraint(TOOLS), tokenizer, vocab(tokenizer))
    head = '{"name": "get_weather", "arguments": {"city": "Zürich Hauptbahnh'
    full = head + 'of"}}'
    # the committed text ends inside one of this member's tokens
    assert not tokenize(tokenizer, full).is_boundary(len(head))
    state = compiled.start()
    assert state.accept_text(head)
    allowed = state.allowed()
    assert allowed[tokenizer.encode("of", add_special_tokens=False)[0]]
    assert not allowed[sorted(compiled.eos_token_ids)].any() and not state.can_end
    # the position depends on the text only, not on how it was split
    pieces = compiled.start()
    for chunk in (head[:7], head[7:30], *head[30:]):
        assert pieces.accept_text(chunk)
    assert torch.equal(pieces.allowed(), allowed)
    for token in tokenizer.encode('of"}}', add_special_tokens=False):
        assert state.accept_token(token)
    assert state.can_end and state.finished
    # a rejected text changes nothing
    other = compiled.start()
    assert other.accept_text('{"name": "get_weather", "arguments": {"city": "Bern"')
    before = other.allowed().clone()
    assert not other.accept_text(', "zzz": 1')
    assert torch.equal(other.allowed(), before) and other.steps == 1


def test_accepts_text_leaves_state_unchanged(tokenizer) -> None:
    state = compile_constraint(JsonConstraint(NESTED), tokenizer, vocab(tokenizer)).start()
    assert state.accept_text('{"name": "Ann", "age": 4')
    before, steps = state.allowed().clone(), state.steps
    assert state.accepts_text('2, "color": "gr')
    assert not state.accepts_text('2, "colour": "red"')
    assert not state.accepts_text("200")  # maximum 150
    assert state.accepts_text('2, "color": "青"}', end=True)
    assert not state.accepts_text('2, "color": "青"', end=True)  # valid prefix, not complete
    assert state.steps == steps and torch.equal(state.allowed(), before)
    assert state.accept_text('2, "color": "青"}') and state.can_end


def test_rollback_restores_mask_exactly(tokenizer) -> None:
    compiled = compile_constraint(tool_call_constraint(TOOLS), tokenizer, vocab(tokenizer))
    state = compiled.start()
    assert state.accept_text('{"name": "send_email", "arguments": {"to": "a@b.c", "subject": "')
    mark, before = state.checkpoint(), state.allowed().clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(16):  # a drafted run of 16 tokens
        token = int(state.mask_logits(torch.randn(state.vocab_size, generator=gen)).argmax())
        assert state.accept_token(token)
    assert state.steps == mark.steps + 16
    state.restore(mark)
    assert torch.equal(state.allowed(), before) and state.steps == mark.steps
    # rollback(n) counts steps: a text is one step, tokens one each, the EOS one
    assert state.accept_text('hi"}}')
    assert state.accept_token(min(compiled.eos_token_ids)) and state.finished
    state.rollback(2)
    assert torch.equal(state.allowed(), before) and not state.finished
    with pytest.raises(ConstraintError):
        state.rollback(state.steps + 1)
    with pytest.raises(ConstraintError, match="another ConstraintState"):
        compiled.start().restore(mark)


def test_can_end_only_when_complete(tokenizer) -> None:
    compiled = compile_constraint(tool_call_constraint(TOOLS), tokenizer, vocab(tokenizer))
    state = compiled.start()
    eos = sorted(compiled.eos_token_ids)
    text = '{"name": "search_web", "arguments": {"query": "x y", "max_results": 3}}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i, token in enumerate(ids):
        assert not state.can_end and not state.finished
        assert not state.allowed()[eos].any() and not state.accept_token(eos[0])
        assert state.accept_token(token), (i, token)
    assert state.can_end and state.finished and state.allowed()[eos].all()
    assert state.accept_token(eos[0])
    assert state.allowed().nonzero().flatten().tolist() == eos  # after EOS only EOS (no all -inf rows)
    assert not state.accept_text(" ") and not state.accept_token(ids[0])
    # a top-level number can end after "12" but could also go on: can_end without finished
    number = compile_constraint(JsonConstraint({"type": "integer"}), tokenizer, vocab(tokenizer)).start()
    assert number.accept_text("12") and number.can_end and not number.finished
    # integers without bounds stop at the I-JSON range (a weak model cannot loop on digits)
    assert number.accept_text("0" * 14)  # 16 digits: 1.2e15 < 2**53
    assert not number.accepts_text("0") and number.can_end
    days = compile_constraint(JsonConstraint({"type": "object", "properties": {"d": {"type": ["integer", "null"]},
                                                                                 "e": {"type": "integer", "minimum": 5}}}),
                              tokenizer, vocab(tokenizer)).start()
    assert days.accepts_text('{"d": 9007199254740991, "e": 9007199254740991}', end=True)
    assert not days.accepts_text('{"d": 9007199254740992') and not days.accepts_text('{"d": -90071992547409910')
    assert not days.accepts_text('{"d": 1, "e": 4}', end=True) and days.accepts_text('{"d": 1, "e": 40}', end=True)
    # json_object mode: no whitespace before the value, nothing after it
    obj = compile_constraint(JsonConstraint(None), tokenizer, vocab(tokenizer)).start()
    assert not obj.accepts_text(" {") and not obj.accepts_text("[1]")
    assert obj.accept_text('{"a": [1, {"b": null}]') and not obj.can_end
    assert obj.accept_text("}") and obj.can_end and not obj.accepts_text(" ")


def test_special_tokens_never_inside_the_value(tokenizer) -> None:
    compiled = compile_constraint(JsonConstraint(None), tokenizer, vocab(tokenizer))
    state = compiled.start()
    assert state.accept_text('{"k": "some text ')
    allowed = state.allowed()
    special = sorted({i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | set(tokenizer.all_special_ids))
    assert not allowed[special].any()
    assert not allowed[len(tokenizer):].any()  # padding rows
    assert allowed.sum() > 0.9 * (len(tokenizer) - len(special))  # almost any text token continues a string


def test_token_table_matches_decode(tokenizer) -> None:
    """The bytes the grammar sees per token equal the project's decoding of that token."""
    tokens, special = token_table(tokenizer)
    gen = torch.Generator().manual_seed(0)
    sample_ids = torch.randint(0, len(tokens), (3000,), generator=gen).tolist() + list(tokenizer.added_tokens_decoder)
    checked = 0
    for i in sample_ids:
        if i in special:
            continue
        try:
            text = tokens[i].decode("utf-8")
        except UnicodeDecodeError:
            continue  # a token that ends inside a character (byte tokens, partial UTF-8)
        assert decode(tokenizer, [i]) == text, (i, tokens[i])
        checked += 1
    assert checked > 2000


def test_bounded_integers_keeps_the_schemas_own_bounds() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "exclusiveMaximum": 10}, "b": {"type": "number"}},
              "$defs": {"N": {"type": "integer"}}, "anyOf": [{"items": {"type": ["integer", "string"], "minimum": 0}}]}
    out = bounded_integers(schema)
    assert out["properties"]["a"] == {"type": "integer", "exclusiveMaximum": 10, "minimum": -MAX_SAFE_INTEGER}
    assert out["properties"]["b"] == {"type": "number"}  # numbers are not bounded (1e300 is a fine double)
    assert out["$defs"]["N"] == {"type": "integer", "minimum": -MAX_SAFE_INTEGER, "maximum": MAX_SAFE_INTEGER}
    assert out["anyOf"][0]["items"]["minimum"] == 0 and out["anyOf"][0]["items"]["maximum"] == MAX_SAFE_INTEGER
    assert schema["properties"]["a"] == {"type": "integer", "exclusiveMaximum": 10}  # the input is not changed
    assert JsonConstraint(schema).schema == schema  # the constraint keeps the caller's schema; only its grammar is bounded
    inverted = bounded_integers({"contains": {"type": "integer"}, "not": {"type": "integer"}})
    assert inverted["contains"]["maximum"] == MAX_SAFE_INTEGER and inverted["not"] == {"type": "integer"}  # not: untouched


def test_states_follow_committed_text_across_tokenizers() -> None:
    """SAFE/SpecEM: one member's tokens are committed as text; the other member's state follows it."""
    constraint = tool_call_constraint(TOOLS)
    a_tok, b_tok = (bundled_tokenizer(a) for a in TOKENIZERS)
    a = compile_constraint(constraint, a_tok, vocab(a_tok))
    b = compile_constraint(constraint, b_tok, vocab(b_tok))
    for seed in range(3):
        for (src_tok, src), (dst_tok, dst) in (((a_tok, a), (b_tok, b)), ((b_tok, b), (a_tok, a))):
            writer, follower = src.start(), dst.start()
            ids = sample(writer, src_tok, seed)
            decoder = IncrementalDecoder(src_tok)
            for token in ids:  # commit token by token; each delta is whole characters
                delta = decoder.push([token])
                assert follower.accept_text(delta), (decoder.text, delta)
            assert follower.accept_text(decoder.flush())
            assert follower.can_end and follower.accept_token(min(dst.eos_token_ids))
            check_output(dst_tok, dst_tok.encode(decoder.text, add_special_tokens=False), constraint)


# ----------------------------------------------------------------------------- vocab size / members
def test_masks_have_the_models_vocab_size(tokenizer) -> None:
    v = len(tokenizer) + 100
    compiled = compile_constraint(JsonConstraint(NESTED), tokenizer, v)
    state = compiled.start()
    assert state.allowed().shape == (v,) and state.allowed().dtype == torch.bool
    rows = state.mask_logits(torch.zeros(3, v))
    assert rows.shape == (3, v) and torch.isinf(rows[:, len(tokenizer):]).all()
    assert not state.accept_token(v - 1) and not state.accept_token(v + 5)
    with pytest.raises(ConstraintError, match="vocab_size"):
        state.mask_logits(torch.zeros(len(tokenizer)))
    ids = sample(state, tokenizer, seed=1)
    assert max(ids) < len(tokenizer)
    with pytest.raises(ConstraintError, match="never end"):
        compile_constraint(JsonConstraint(NESTED), tokenizer, v, eos_token_ids=[v + 5])


def test_padded_tiny_member_decodes_a_valid_tool_call() -> None:
    """A tiny model with more output rows than tokens, greedy under the mask: the call must parse."""
    tok = bundled_tokenizer("smollm2-135m-instruct")
    member = tiny_member("smollm2-135m-instruct", seed=3, vocab_size=len(tok) + 37)
    assert member.vocab_size == len(tok) + 37
    tools = [{"name": "set_mode", "parameters": {"type": "object", "properties": {
        "mode": {"enum": ["fast", "slow", "off"]}, "verbose": {"type": "boolean"}}, "required": ["mode", "verbose"]}}]
    constraint = tool_call_constraint(tools, "set_mode")  # a finite language: greedy decoding must end
    state = compile_for_member(constraint, member).start()
    decoding = member.start("Switch to fast mode.")
    row = decoding.score()[-1]
    ids: list[int] = []
    for _ in range(200):
        token = int(state.mask_logits(row).argmax())
        assert state.accept_token(token)
        if token in member.eos_token_ids:
            break
        ids.append(token)
        row = decoding.score([token])[-1]
    value = json.loads(decode(tok, ids))
    assert value["name"] == "set_mode" and value["arguments"]["mode"] in {"fast", "slow", "off"}


def test_compiled_constraints_are_cached(tokenizer) -> None:
    first = compile_constraint(JsonConstraint(NESTED), tokenizer, vocab(tokenizer))
    assert compile_constraint(JsonConstraint(json.loads(json.dumps(NESTED))), tokenizer, vocab(tokenizer)) is first
    # property order is part of the constraint (the output follows it), so it is part of the identity
    reordered = JsonConstraint(dict(reversed(NESTED.items())))
    assert reordered != JsonConstraint(NESTED) and reordered.schema == NESTED
    assert compile_constraint(JsonConstraint(NESTED), tokenizer, vocab(tokenizer) + 1) is not first
    a, b = first.start(), first.start()
    assert a.accept_text('{"name": "x"') and b.steps == 0  # states are independent


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("schema, problem", [
    ({"type": "foo"}, "Invalid type"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ("{'type': 'object'}", "expected a dict"),
    ({"enum": [{1, 2}]}, "not JSON"),
])
def test_bad_schema_is_a_typed_error(schema, problem: str) -> None:
    with pytest.raises(InvalidSchemaError, match=problem) as info:
        JsonConstraint(schema)
    assert isinstance(info.value, InputError)
    assert info.value.fix and info.value.fix in str(info.value)


@pytest.mark.parametrize("fmt", ["path", "binary", "password", "ipvanyaddress", "uri-reference", "made-up"])
def test_formats_the_engine_does_not_implement_are_annotations(fmt: str) -> None:
    """pydantic's Path / bytes / SecretStr / IPvAnyAddress write such formats: the string is left free (JSON
    Schema's annotation semantics); the formats the engine implements are still enforced."""
    schema = {"type": "object", "properties": {"p": {"type": "string", "format": fmt},
                                               "d": {"type": "string", "format": "date"}}}
    state = compile_constraint(JsonConstraint(schema), bundled_tokenizer(TOKENIZERS[0]), vocab(
        bundled_tokenizer(TOKENIZERS[0]))).start()
    assert JsonConstraint(schema).schema == schema  # the validator still sees the schema as given
    assert state.accepts_text('{"p": "/tmp/a b.txt", "d": "2024-06-07"}')
    assert not state.accepts_text('{"p": "x", "d": "June"}')
    tool = {"name": "read_file", "parameters": schema}
    tool_call_constraint([tool])  # forced call, and the lazy call grammar of tool_choice="auto"
    call_format_constraint([tool])


def test_date_time_has_no_leap_second() -> None:
    """pydantic's datetime / time refuse second 60, which RFC 3339 (and the engine's format) allow."""
    tokenizer = bundled_tokenizer(TOKENIZERS[0])
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                               "at": {"type": "string", "format": "time"}}}
    state = compile_constraint(JsonConstraint(schema), tokenizer, vocab(tokenizer)).start()
    assert state.accepts_text('{"when": "2024-06-07T13:26:59.5+02:00", "at": "13:26:59Z"}')
    assert not state.accepts_text('{"when": "2024-06-07T13:26:60Z"')
    assert not state.accepts_text('{"at": "23:59:60Z"')
    assert not state.accepts_text('{"when": "2024-02-30T00:00:00Z"')  # the engine's own checks stay


@pytest.mark.parametrize("schema, feature", [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
])
def test_unsupported_features_are_typed_with_a_fix_users_can_apply(schema, feature: str) -> None:
    with pytest.raises(UnsupportedSchemaFeatureError) as info:
        JsonConstraint(schema)
    assert info.value.feature == feature
    assert "coerce_one_of" not in str(info.value) and "Enable" not in str(info.value)
    disjoint = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                           "required": ["kind", "r"]},
                          {"type": "object", "properties": {"kind": {"const": "square"}, "a": {"type": "number"}},
                           "required": ["kind", "a"]}]}
    JsonConstraint(disjoint)  # a discriminated union (pydantic's tagged unions) compiles


def test_tool_errors() -> None:
    with pytest.raises(UnknownToolError, match="get_wether.*get_weather, search_web, send_email") as info:
        tool_call_constraint(TOOLS, "get_wether")
    assert isinstance(info.value, InputError) and isinstance(info.value, KeyError)
    with pytest.raises(ConstraintError, match="nothing to constrain"):
        tool_call_constraint(TOOLS, "auto")
    with pytest.raises(ConstraintError, match="unique"):
        tool_call_constraint(TOOLS + TOOLS[:1])
    with pytest.raises(ConstraintError, match="no name"):
        tool_call_constraint([{"type": "function", "function": {"parameters": {}}}])
    with pytest.raises(ConstraintError, match="at least one tool"):
        tool_call_constraint([])
    with pytest.raises(InvalidSchemaError, match="tool 'bad' parameters: expected a dict"):
        tool_call_constraint([{"name": "bad", "parameters": "city: str"}])
    with pytest.raises(InvalidSchemaError, match="tool 'bad' parameters"):
        tool_call_constraint([{"name": "bad", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}])


def test_missing_library_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(MissingDependencyError, match="pip install 'llguidance"):
        JsonConstraint({"type": "object"})
