"""What a new user hits in the first hour: the distribution name, constructor keywords,
mistyped aliases, bad text input and option semantics — one test per item, plus a
property-based test that feeds generated prompts through every entry point.

Everything runs on tiny random-weight members with the real tokenizers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_ensemble import ChatEnsemble
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.llms.ensemble import EnsembleLLM

from ensemble_core import (
    ConfigurationError,
    Ensemble,
    EnsembleError,
    InputError,
    InvalidOptionError,
    Member,
    NoMembersError,
    UnknownAliasError,
    UnknownOptionError,
)
from ensemble_core.models import loading as members
from ensemble_core.testing import tiny_member

REPO = Path(__file__).resolve().parents[1]
FFFD = "\ufffd"
#: Files a user reads or runs (code, docs, notebooks).
USER_FACING = ["README.md", "docs", "notebooks", "ensemble_core", "integrations", "pyproject.toml"]


@pytest.fixture(scope="module")
def pair() -> list[Member]:
    return [tiny_member("gemma3-270m", seed=0, name="fc-gemma"), tiny_member("smollm2-135m-instruct", seed=0,
                                                                           name="fc-smollm2")]


# --------------------------------------------------------------------------- 1. distribution name
def test_the_distribution_name_is_ours_everywhere() -> None:
    name = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
    assert name == "tokensemble"  # "llm-ensemble" on the registry is an unrelated 2024 project
    taken = "llm-ensemble"
    for entry in USER_FACING:
        for path in [REPO / entry] if (REPO / entry).is_file() else (REPO / entry).rglob("*"):
            if path.is_file() and path.suffix in (".md", ".py", ".toml", ".ipynb") and "__pycache__" not in path.parts:
                assert taken not in path.read_text(encoding="utf-8"), path
    assert f'pip install "{name}[langchain]"' in (REPO / "README.md").read_text()


#: A repository path in backticks (``ensemble_core/decoding/slab.py``, ``tests/data/rag``, ``docs/results/x-*``).
DOC_PATH = re.compile(r"`((?:ensemble_core|integrations|tests|docs|notebooks)/[A-Za-z0-9_./*\-]+)")


def test_every_repository_path_the_docs_name_exists() -> None:
    """A page that names a moved or deleted file sends the reader nowhere (an audit found eight such paths
    after modules moved into packages). A line that says the file was removed may name it."""
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "integrations").rglob("README.md")]
    missing = []
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOC_PATH.finditer(line):
                path = match.group(1).rstrip(".")
                if "removed" not in line and not list(REPO.glob(path)):
                    missing.append(f"{page.relative_to(REPO)}:{number}: {path}")
    assert not missing, "\n".join(missing)


# --------------------------------------------------------------------------- 2. constructor keywords
def test_llamaindex_accepts_the_usual_names_and_rejects_the_rest(pair: list[Member]) -> None:
    llm = EnsembleLLM(members=pair, method="safe", max_tokens=8, lookahead=3, context_window=1000)
    assert llm.max_new_tokens == 8 and llm.method_config == {"lookahead": 3}
    assert llm.metadata.context_window == 1000 and llm.metadata.num_output == 8
    with pytest.raises(ConfigurationError, match="foo"):
        EnsembleLLM(members=pair, foo=1)
    with pytest.raises(ConfigurationError, match="exceeds the smallest member window"):
        EnsembleLLM(members=pair, context_window=10**6)


@pytest.mark.parametrize("make", [
    lambda pair: Ensemble(pair, method="safe", lookahed=3),
    lambda pair: Ensemble(pair, method="safe").generate("Hi", lookahed=3),
    lambda pair: ChatEnsemble(members=pair, method="safe", lookahed=3),
    lambda pair: ChatEnsemble(members=pair, method="safe").invoke("Hi", lookahed=3),
    lambda pair: EnsembleLLM(members=pair, method="safe", lookahed=3),
])
def test_a_mistyped_option_is_refused_with_the_name_meant(pair: list[Member], make: Any) -> None:
    """Every layer refuses an option nothing takes with one error class that names the closest option."""
    with pytest.raises(UnknownOptionError, match="Unknown option.*lookahed.*Did you mean: lookahed -> lookahead"):
        make(pair)


@pytest.mark.parametrize("make", [
    lambda pair: EnsembleLLM(members=pair, temperature="hot"),
    lambda pair: ChatEnsemble(members=pair, temperature="hot"),
    lambda pair: EnsembleLLM(members=pair, max_new_tokens=0),
    lambda pair: ChatEnsemble(members=pair, streaming="sometimes"),
])
def test_constructor_validation_raises_the_librarys_error(pair: list[Member], make: Any) -> None:
    with pytest.raises(ConfigurationError) as err:
        make(pair)
    assert isinstance(err.value, EnsembleError) and err.value.__cause__ is not None  # pydantic's details chained


# --------------------------------------------------------------------------- 3. mistyped aliases fail fast
def test_a_mistyped_alias_is_refused_with_a_suggestion_and_no_hub_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(members, "hub_reachable", lambda: calls.append("hub") or False)
    with pytest.raises(UnknownAliasError, match="Did you mean 'smollm2-135m-instruct'"):
        Member.load("smollm2-135m-instuct")
    with pytest.raises(UnknownAliasError, match="not a valid Hugging Face model id"):
        Member.load("my model, please")
    with pytest.raises(UnknownAliasError, match="not a valid Hugging Face model id"):
        Member.load("/no/such/dir/model.gguf")
    assert calls == []  # decided from the name alone


def test_an_unreachable_hub_is_asked_once_and_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(members, "hub_reachable", lambda: asked.append("hub") or False)
    with pytest.raises(UnknownAliasError, match="cannot be reached"):
        Member.load("some-org/no-such-model-xyz")
    assert 1 <= len(asked) <= 2  # one connection probe (the error message asks again), no retries


# --------------------------------------------------------------------------- 4. bad text input
@pytest.mark.parametrize("prompt, match", [
    ("\ud800", "lone surrogate U\\+D800"), ("", "empty"), ("   \n\t", "no text"), (None, "NoneType"), (123, "int"),
    ([{"role": "user", "content": "ok \udfff"}], "Message 0 .*surrogate"), ([{"role": "critic", "content": "x"}], "role"),
])
def test_bad_text_gets_a_typed_error_in_every_layer(pair: list[Member], prompt: Any, match: str) -> None:
    ens = Ensemble(pair, method="safe", max_new_tokens=2)
    with pytest.raises(InputError, match=match):
        ens.generate(prompt)
    if isinstance(prompt, str):
        with pytest.raises(InputError):
            ChatEnsemble(members=pair, max_tokens=2).invoke(prompt)
        with pytest.raises(InputError):
            EnsembleLLM(members=pair, max_new_tokens=2).chat([ChatMessage(role=MessageRole.USER, content=prompt)])


# --------------------------------------------------------------------------- 5. option semantics
def test_temperature_zero_is_greedy_everywhere(pair: list[Member]) -> None:
    greedy = Ensemble(pair, method="single", max_new_tokens=6).generate("Hi").text
    assert Ensemble(pair, method="single", max_new_tokens=6, temperature=0).generate("Hi").text == greedy
    assert Ensemble(pair, method="single", max_new_tokens=6, do_sample=True, temperature=0).generate("Hi").text == greedy
    assert ChatEnsemble(members=pair, method="single", max_tokens=6, temperature=0).invoke("Hi").content == greedy
    assert EnsembleLLM(members=pair, method="single", max_tokens=6, temperature=0).complete("Hi").text == greedy


def test_member_count_and_strict_types(pair: list[Member]) -> None:
    with pytest.raises(NoMembersError, match="at least 2 member"):
        Ensemble([], method="safe")
    with pytest.raises(NoMembersError, match="at least 2 member"):
        Ensemble(pair[:1], method="safe")
    for bad in ("10", True, 2.5):
        with pytest.raises(InvalidOptionError):
            Ensemble(pair, method="safe", max_new_tokens=bad)
        with pytest.raises(InvalidOptionError):
            ChatEnsemble(members=pair, method="safe").invoke("Hi", max_tokens=bad)
        with pytest.raises(InvalidOptionError):
            EnsembleLLM(members=pair, method="safe").complete("Hi", max_tokens=bad)


# --------------------------------------------------------------------------- fuzz
SPECIAL = ["", " ", "\x00", "\x1b[31m", "\u202eevil", "\u200d", "👨\u200d👩\u200d👧", "e\u0301", "東京", "\ufffd",
           "\ud800", "\udfff", "<|im_end|>", "<start_of_turn>", "\nUser:", "a" * 5000]
any_char = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=())
texts = st.one_of(st.text(any_char, max_size=40), st.sampled_from(SPECIAL),
                  st.lists(st.sampled_from(SPECIAL), max_size=4).map("".join))
parts = st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           st.fixed_dictionaries({"type": st.sampled_from(["image", "reasoning", "audio", None])}),
                           texts, st.integers()), max_size=3)
core_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "robot", None, 3]),
    "content": st.one_of(texts, parts, st.none(), st.integers()),
}), max_size=4)
core_prompts = st.one_of(texts, core_messages, st.none(), st.integers(), st.binary(max_size=8),
                         st.just({"role": "user", "content": "hi"}))
TRIED = {"core": 0, "langchain": 0, "llamaindex": 0}


def _check(call: Any) -> None:
    try:
        text = call()
    except EnsembleError:
        return
    assert isinstance(text, str) and FFFD not in text, repr(text)


FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(prompt=core_prompts)
def _fuzz_core_generate(prompt: Any) -> None:
    TRIED["core"] += 1
    _check(lambda: Ensemble(_fuzz_pair(), method="safe", max_new_tokens=3).generate(prompt).text)


lc_messages = st.lists(st.tuples(st.sampled_from([HumanMessage, SystemMessage, AIMessage]), texts)
                       .map(lambda t: t[0](content=t[1])), min_size=1, max_size=3)


@FUZZ
@given(prompt=st.one_of(texts, lc_messages))
def _fuzz_langchain_invoke(prompt: Any) -> None:
    TRIED["langchain"] += 1
    _check(lambda: ChatEnsemble(members=list(_fuzz_pair()), max_tokens=3).invoke(prompt).content)


li_messages = st.lists(st.tuples(st.sampled_from(list(MessageRole)), texts)
                       .map(lambda t: ChatMessage(role=t[0], content=t[1])), min_size=0, max_size=3)


@FUZZ
@given(messages=li_messages)
def _fuzz_llamaindex_chat(messages: list[ChatMessage]) -> None:
    TRIED["llamaindex"] += 1
    _check(lambda: EnsembleLLM(members=list(_fuzz_pair()), max_new_tokens=3).chat(messages).message.content)


_PAIR: list[Member] = []


def _fuzz_pair() -> list[Member]:
    if not _PAIR:
        _PAIR.extend([tiny_member("gemma3-270m", seed=1, name="fz-gemma"),
                      tiny_member("smollm2-135m-instruct", seed=1, name="fz-smollm2")])
    return _PAIR


def _tried(kind: str, run: Any) -> int:
    """Run one fuzz property and return how many generated inputs it tried.

    Counted inside the same test (not in a separate report test): under xdist a report test can
    land on another worker than the fuzz tests and would read a count of 0 there.
    """
    before = TRIED[kind]
    run()
    tried = TRIED[kind] - before
    print(f"fuzz inputs tried ({kind}): {tried}")
    return tried


def test_fuzz_core_generate() -> None:
    assert _tried("core", _fuzz_core_generate) > 0


def test_fuzz_langchain_invoke() -> None:
    assert _tried("langchain", _fuzz_langchain_invoke) > 0


def test_fuzz_llamaindex_chat() -> None:
    assert _tried("llamaindex", _fuzz_llamaindex_chat) > 0
