"""Every typed error of the foundation, raised with a message that names the fix; loading paths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ensemble_core import (
    Ensemble,
    InvalidOptionError,
    Member,
    MemberSpec,
    MissingDependencyError,
    NoMembersError,
    PromptTooLongError,
    UnknownAliasError,
)
from ensemble_core.errors import ConfigurationError, EnsembleError, InputError, ModelLoadError
from ensemble_core.models import bundled
from ensemble_core.models.bundled import BUNDLED, convert_gguf, converted_dir, remove_mtime_keyed_copies
from ensemble_core.models.loading import load_objects


def test_hierarchy() -> None:
    for cls in (InvalidOptionError, NoMembersError):
        assert issubclass(cls, ConfigurationError) and issubclass(cls, ValueError)
    for cls in (UnknownAliasError, MissingDependencyError):
        assert issubclass(cls, ModelLoadError)
    assert issubclass(PromptTooLongError, InputError)
    assert all(issubclass(c, EnsembleError) for c in (ConfigurationError, ModelLoadError, InputError))


def test_errors_pickle_with_message_and_fields() -> None:
    """A worker process or a Ray actor sends errors back pickled; most build their message from
    fields, so a plain ``Exception`` pickle would call ``__init__`` with the wrong arguments."""
    import pickle

    from ensemble_core import errors

    made = [errors.InvalidOptionError("lookahead", 0, "an integer >= 1"), errors.NoMembersError(1, 2),
            errors.UnknownAliasError("smol", ["smollm2-135m-instruct"], "smollm2-135m-instruct"),
            errors.MissingDependencyError("ray", "remote members"), errors.UnsupportedAttentionError("m", "flash"),
            errors.PromptTooLongError("m", 900, 200, 1024), errors.GenerationTimeout(2.5, "partial"),
            errors.InvalidSchemaError("no type", "add one"), errors.UnknownToolError("add", ["multiply"]),
            errors.ModelLoadError("plain message"), errors.NotPicklableError("ChatEnsemble", ["Member 'a'"])]
    for error in made:
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
    assert pickle.loads(pickle.dumps(made[6])).text_so_far == "partial"


def test_no_members() -> None:
    with pytest.raises(NoMembersError, match="at least 1 member"):
        Ensemble([], method="single")


def test_unknown_alias_names_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownAliasError) as err:
        Member.load("smollm-135m-instruct")  # typo
    msg = str(err.value)
    assert "smollm-135m-instruct" in msg and "smollm2-135m-instruct" in msg and "gemma3-270m" in msg


def test_missing_gguf_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf → ImportError
    with pytest.raises(MissingDependencyError, match="pip install gguf"):
        convert_gguf(fake)


def test_conversion_cache_keys_a_reinstalled_file_by_its_content(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """A reinstall (new venv, --force-reinstall, CI clone) gives the bundled GGUF file a new mtime: the
    cache must find the same conversion (it was keyed by mtime and left 0.5-2.4 GB per reinstall)."""
    import os
    import shutil

    monkeypatch.setenv("ENSEMBLE_CACHE_DIR", str(tmp_path / "cache"))
    original = BUNDLED["smollm2-135m-instruct"].locate()
    copy = tmp_path / "venv2" / original.name
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    os.utime(copy, ns=(original.stat().st_mtime_ns + 10**12,) * 2)
    hashed = []
    real_sha256 = bundled._sha256
    monkeypatch.setattr(bundled, "_sha256", lambda *paths: hashed.append(paths) or real_sha256(*paths))
    assert converted_dir(copy) == converted_dir(original)
    assert converted_dir(copy) == converted_dir(original) and len(hashed) == 2  # hashed once each, then stamped
    copy.write_bytes(b"GGUF" + copy.read_bytes()[4:-1] + b"x")  # same size, other content: another key
    os.utime(copy, ns=(original.stat().st_mtime_ns + 2 * 10**12,) * 2)
    assert converted_dir(copy) != converted_dir(original) and len(hashed) == 3


def test_conversions_keyed_by_mtime_are_removed_once_stale(tmp_path: Path) -> None:
    import os
    import time

    converted = tmp_path / "converted"
    target = converted / "model.Q4-1000-0123456789abcdef"
    names = ["model.Q4-1000-1796609271", "model.Q4-1000-1796615677", "model.Q4-1000-1796685494",
             "model.Q4-2000-1796609271", "other-1000-1796609271", "model.Q4-1000-9876543210fedcba"]
    for name in [target.name, *names]:
        (converted / name).mkdir(parents=True)
    hour_ago = time.time() - 7200
    for name in names[:2] + names[3:]:
        os.utime(converted / name, (hour_ago, hour_ago))
    removed = remove_mtime_keyed_copies(target)
    assert sorted(p.name for p in removed) == names[:2]  # the fresh one may still be in use; others are not copies
    assert sorted(p.name for p in converted.iterdir()) == sorted([target.name, *names[2:]])


def test_prompt_longer_than_context_window(tiny_llama: Member) -> None:
    window = tiny_llama.context_window
    with pytest.raises(PromptTooLongError) as err:
        tiny_llama.start("word " * window, max_new_tokens=10)
    assert str(window) in str(err.value) and "max_new_tokens" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        (dict(source="x", dtype="float8"), "dtype"),
        (dict(source="x", device="gpu0"), "device"),
        (dict(source="x", device="cpu", device_map="auto"), "device_map"),
        (dict(source=""), "source"),
        # found by a pass over the member options: these crashed inside transformers / jinja2 / torch, or (the
        # string "no") reached transformers as a true trust_remote_code
        (dict(source="x", dtype=["float32"]), "dtype"),
        (dict(source="x", dtype=torch.int8), "dtype"),
        (dict(source="x", device_map=123), "device_map"),
        (dict(source="x", chat_template=123), "chat_template"),
        (dict(source="x", chat_template=""), "chat_template"),
        (dict(source="x", chat_template="{% for m in messages %}{{ m.content }"), "chat_template"),
        (dict(source="x", attn_implementation=5), "attn_implementation"),
        (dict(source="x", trust_remote_code="no"), "trust_remote_code"),
    ],
)
def test_invalid_member_options(kwargs: dict, option: str) -> None:
    with pytest.raises(InvalidOptionError, match=option):
        MemberSpec(**kwargs)


def test_member_options_are_checked_by_name_and_member_load_applies_them(tiny_llama: Member, tmp_path: Path) -> None:
    """member_options with a typo, 'source', or a dict member without 'source' raised a bare TypeError;
    Member.load(spec, **options) dropped the options."""
    from ensemble_core.errors import UnknownOptionError

    with pytest.raises(UnknownOptionError, match="dtyp -> dtype"):
        Ensemble(["smollm2-135m-instruct"], method="single", member_options={"dtyp": "float32"})
    with pytest.raises(ConfigurationError, match="cannot set 'source'"):
        Ensemble(["smollm2-135m-instruct"], method="single", member_options={"source": "x"})
    with pytest.raises(ConfigurationError, match="needs its 'source'"):
        Ensemble([{"dtype": "float32"}], method="single")
    tiny_llama.model.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    assert Member.load(MemberSpec(str(tmp_path)), name="renamed", prefix_cache=0).name == "renamed"
    from ensemble_core.models.loading import load_key

    spellings = [MemberSpec(str(tmp_path), dtype=d, device=v) for d in ("auto", "float32", torch.float32)
                 for v in (None, "cpu")]
    assert len({load_key(s) for s in spellings}) == 1  # one copy of the weights, however the options are written
    assert load_key(MemberSpec(str(tmp_path), dtype="bfloat16")) != load_key(spellings[0])


def test_a_device_this_process_lacks_is_refused_before_the_weights_load() -> None:
    """torch would fail in ``model.to(...)`` after the load ("Torch not compiled with CUDA enabled")."""
    from ensemble_core.models.loading import device_problem

    assert device_problem("cpu") is None and "meta" in device_problem("meta")
    assert device_problem("cuda:99") is not None  # no CUDA in this torch build, or not 100 GPUs
    for device in ("cuda:99", "meta"):
        with pytest.raises(InvalidOptionError, match="'device'.*'cpu' always works"):
            Member.load("smollm2-135m-instruct", device=device)  # bundled: would load in seconds, if it got there


def test_a_seed_beyond_64_bits_is_refused() -> None:
    from ensemble_core.decoding.generation import GenerationConfig

    for seed in (2**64 - 1, -2**63, 0, None):
        assert GenerationConfig(seed=seed).seed == seed
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(InvalidOptionError, match="seed.*64 bits"):
            GenerationConfig(seed=seed)


def test_bad_member_objects(tiny_llama: Member) -> None:
    with pytest.raises(InputError):
        Member(None, tiny_llama.tokenizer)
    with pytest.raises(ConfigurationError, match="Cannot build a member"):
        Ensemble([42], method="single")


def test_members_from_objects_and_local_directory(tiny_llama: Member, tmp_path: Path) -> None:
    ens = Ensemble([(tiny_llama.model, tiny_llama.tokenizer)], method="single", max_new_tokens=3)
    assert ens.members[0].model is tiny_llama.model
    tiny_llama.model.save_pretrained(tmp_path)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    a = load_objects(MemberSpec(str(tmp_path)))
    b = load_objects(MemberSpec(str(tmp_path)))
    assert a[0] is b[0]  # cached per process
    member = Member.load(str(tmp_path))
    assert member.name == tmp_path.name and member.vocab_size == tiny_llama.vocab_size
