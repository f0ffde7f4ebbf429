"""Ensemble members: a model, its tokenizer, its chat format, its device, its decoding state.

A :class:`Member` is shared (weights are loaded once per process, see :func:`load_member`);
a :class:`DecodeState` is per request: the member's own token ids for
``prompt + response so far`` and a KV cache over them. All cross-member exchange goes
through text (see :mod:`ensemble_core.alignment`).
"""

from __future__ import annotations

import difflib
import functools
import os
import platform
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import alignment, batching
from .bundled import BUNDLED, convert_gguf
from .cache import can_crop_exactly, crop, new_cache
from .chat import FALLBACK_STOPS, Prompt, normalize_messages, render_chat, reply_lead, template_supports_tools
from .errors import (
    InputError,
    InvalidOptionError,
    MissingDependencyError,
    ModelLoadError,
    PromptTooLongError,
    UnknownAliasError,
)
from .products import available_memory, should_prepack, use_cpu_products
from .quantize import check_scheme, quantize
from .structured import StructuredRequest, with_instructions

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MemberSpec:
    """How to load one member.

    ``source`` is a built-in alias (``smollm2-135m-instruct``, ``gemma3-270m``), a local
    directory, a ``.gguf`` file, or a Hugging Face model id. ``dtype`` is ``"auto"``
    (float32 on CPU, bfloat16 on GPU), a name or a torch dtype. ``device`` places the whole
    model (``"cpu"``, ``"cuda:1"``); ``device_map`` hands placement to accelerate
    (``"auto"`` or a dict) and excludes ``device``. ``chat_template`` overrides the
    tokenizer's template; ``attn_implementation`` is passed to transformers. ``quantize``
    (``"int8"``, CPU and float32 only) makes the body's linear layers dynamic int8: faster
    on a CPU, different greedy outputs (see :mod:`ensemble_core.quantize`). ``prepack``: a
    float32 member on a CPU also keeps its linear weights in oneDNN's blocked layout, which
    makes passes of several tokens (verify windows, packed candidates, batched steps,
    prefill) 1.2-2x faster with the same values, for a second copy of those weights in
    memory: None (default) does it when the copy fits easily in the memory available at
    load, True / False decide (see :mod:`ensemble_core.products`).
    """

    source: str
    name: str | None = None
    dtype: Any = "auto"
    device: str | None = None
    device_map: Any = None
    chat_template: str | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    quantize: str | None = None
    prepack: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, (str, os.PathLike)) or not str(self.source).strip():
            raise InvalidOptionError("source", self.source, "an alias, a path or a model id")
        if self.device is not None and self.device_map is not None:
            raise InvalidOptionError("device_map", self.device_map, "None when device is given (pass one of them)")
        if not (self.dtype == "auto" or self.dtype in _DTYPES or isinstance(self.dtype, torch.dtype)):
            raise InvalidOptionError("dtype", self.dtype, "'auto', 'float32', 'float16', 'bfloat16' or a torch.dtype")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise InvalidOptionError("device", self.device, "a torch device string such as 'cpu' or 'cuda:0'") from exc
        check_scheme(self.quantize, _resolve_dtype(self.dtype, self.device), self.device, self.device_map)
        if self.prepack is not None and not isinstance(self.prepack, bool):
            raise InvalidOptionError("prepack", self.prepack, "None (when it fits in memory), True or False")


def per_member_options(count: int, dtype: Any = "auto", devices: Sequence[str] = (),
                       quantize: Sequence[str | None] = (), prepack: bool | None = None) -> list[dict[str, Any]]:
    """Load options of ``count`` members from command-line style lists (one value for all, or one per member).

    ``dtype`` is one value or a list (``["float32", "bfloat16"]``: a float32 drafter next to
    a bfloat16 verifier). ``quantize`` values are ``"int8"`` or ``"none"``/None. ``prepack``
    is one value for all (None: when it fits; False: ``--no-prepack``, one copy of the weights). Shared by
    ``ensemble`` and ``ensemble bench`` so that both read their flags the same way.
    """
    def pick(values: Sequence[Any], flag: str, i: int) -> Any:
        if len(values) not in (1, count):
            raise InvalidOptionError(flag, list(values), f"one value for all members or one per member ({count})")
        return values[i if len(values) > 1 else 0]

    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
    out = []
    for i in range(count):
        opts: dict[str, Any] = {"dtype": pick(dtypes, "--dtype", i)}
        if prepack is not None:
            opts["prepack"] = prepack
        if devices:
            opts["device"] = pick(devices, "--device", i)
        if quantize:
            scheme = pick(quantize, "--quantize", i)
            opts["quantize"] = None if scheme in (None, "none") else scheme
        out.append(opts)
    return out


#: ``/proc/cpuinfo`` flags of x86 instructions that multiply bfloat16 natively (oneDNN uses them).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a ``/proc/cpuinfo`` text (empty if it has none)."""
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() == "flags":
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cpuinfo() -> str:
    """Linux's ``/proc/cpuinfo`` text (empty where it is absent)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (empty where ``/proc/cpuinfo`` is absent)."""
    return parse_cpu_flags(cpuinfo())


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
    for line in cpuinfo().splitlines():
        if line.split(":")[0].strip() == "model name":
            return line.partition(":")[2].strip()
    return platform.processor()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), as oneDNN's kernels need.

    Why it matters: there a bfloat16 member is 1.2-1.6x faster per step and its verify
    windows and batched passes cost about one step (docs/benchmarks.md, "bfloat16 on a CPU
    with native bf16"), while a CPU without it (AVX2 only) gains 1.1-1.4x from memory
    traffic alone. ``dtype="auto"`` still means float32 on every CPU: greedy outputs differ
    between the two dtypes, and a default must not change them from one machine to the next.
    """
    return bool((cpu_flags() if flags is None else flags) & set(NATIVE_BF16_FLAGS))


def _resolve_dtype(dtype: Any, device: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_gpu = device is not None and not str(device).startswith("cpu")
        return torch.bfloat16 if on_gpu else torch.float32
    return _DTYPES[dtype]


def _resolve_source(source: str) -> tuple[Path | str, str | None, str | None]:
    """Return ``(path_or_id, gguf_file, alias)`` for a member source.

    A name that is neither an alias nor an existing path must look like a Hugging Face
    model id; a near-miss of an alias (``"smollm2-135m-instuct"``) fails at once with a
    suggestion instead of asking the hub.
    """
    if source in BUNDLED:
        gguf_path = BUNDLED[source].locate()
        return convert_gguf(gguf_path), None, source
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path), None, None
    if path.is_dir():
        return path, None, None
    suggestion = closest_alias(source)
    if not HUB_ID.fullmatch(source) or source.endswith(".gguf"):
        raise UnknownAliasError(source, list(BUNDLED), suggestion, "not a valid Hugging Face model id either")
    if suggestion and "/" not in source:
        raise UnknownAliasError(source, list(BUNDLED), suggestion, "too close to a built-in alias to be a hub id")
    return source, None, None


#: What a Hugging Face model id looks like: ``name`` or ``owner/name`` of letters, digits, ``-_.``.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
#: How long the hub may take to answer a connection before a look-up is treated as offline.
HUB_CONNECT_TIMEOUT_S = 3.0


def closest_alias(name: str) -> str | None:
    """The built-in alias a mistyped name most likely means (None when nothing is close)."""
    matches = difflib.get_close_matches(name.lower(), list(BUNDLED), n=1, cutoff=0.75)
    return matches[0] if matches else None


@functools.cache
def hub_reachable() -> bool:
    """Whether the Hugging Face endpoint accepts a TCP connection within :data:`HUB_CONNECT_TIMEOUT_S`.

    Asked once per process before the first hub look-up: on a machine without network the
    hub client would otherwise retry for most of a minute before failing.
    """
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname or "", url.port or 443), timeout=HUB_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


_LOADED: dict[tuple, tuple[Any, Any]] = {}
_LOAD_LOCK = threading.Lock()
LOAD_SECONDS: dict[str, float] = {}


def _load_objects(spec: MemberSpec) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, gguf_file, alias = _resolve_source(str(spec.source))
    dtype = _resolve_dtype(spec.dtype, spec.device)
    local = isinstance(target, Path)
    offline = local or os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable()
    kwargs: dict[str, Any] = {"local_files_only": offline, "trust_remote_code": spec.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(target, **kwargs)
        model_kwargs = dict(kwargs, dtype=dtype)
        if spec.device_map is not None:
            model_kwargs["device_map"] = spec.device_map
        if spec.attn_implementation:
            model_kwargs["attn_implementation"] = spec.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(target, **model_kwargs)
    except ImportError as exc:
        if "accelerate" in str(exc):
            raise MissingDependencyError("accelerate", "device_map placement") from exc
        raise ModelLoadError(f"Loading {spec.source!r} failed: {exc}") from exc
    except OSError as exc:
        if not local and alias is None:
            why = None if os.environ.get("HF_HUB_OFFLINE") == "1" or hub_reachable() else (
                "the Hugging Face hub cannot be reached from here and the id is not in the local cache")
            raise UnknownAliasError(str(spec.source), list(BUNDLED), closest_alias(str(spec.source)), why) from exc
        raise ModelLoadError(f"Loading {spec.source!r} from {target} failed: {exc}") from exc
    if spec.device_map is None:
        model.to(spec.device or "cpu")
    model.eval()
    model.requires_grad_(False)
    quantize(model, spec.quantize)  # opt-in, the head stays float32: see quantize.py
    # float32 products on a CPU through oneDNN, prepacked when the copy fits: see products.py
    prepacked = spec.prepack if spec.prepack is not None else should_prepack(model, available_memory())
    use_cpu_products(model, prepacked=prepacked)
    return model, tokenizer


def load_objects(spec: MemberSpec) -> tuple[Any, Any]:
    """Load (or fetch from the per-process cache) a model and tokenizer for ``spec``."""
    key = (str(spec.source), str(spec.dtype), spec.device, repr(spec.device_map),
           spec.attn_implementation, spec.trust_remote_code, spec.quantize, spec.prepack)
    with _LOAD_LOCK:
        if key not in _LOADED:
            t0 = time.perf_counter()
            _LOADED[key] = _load_objects(spec)
            LOAD_SECONDS[str(spec.source)] = time.perf_counter() - t0
        return _LOADED[key]


def clear_loaded() -> None:
    """Forget every model loaded in this process (frees memory once unreferenced)."""
    with _LOAD_LOCK:
        _LOADED.clear()


class Member:
    """One model of an ensemble, with everything needed to decode with it incrementally."""

    def __init__(self, model: Any, tokenizer: Any, name: str | None = None,
                 chat_template: str | None = None, stop_strings: Sequence[str] | None = None) -> None:
        if model is None or tokenizer is None:
            raise InputError("A member needs both a model and a tokenizer.")
        if not hasattr(model, "config") or not callable(model):
            raise InputError(f"{type(model).__name__} is not a transformers causal LM (no config / not callable).")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.chat_template = chat_template
        has_template = bool(chat_template or getattr(tokenizer, "chat_template", None))
        self.stop_strings: tuple[str, ...] = tuple(stop_strings) if stop_strings is not None else (
            () if has_template else FALLBACK_STOPS)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])

    # ---------------------------------------------------------------- construction
    @classmethod
    def load(cls, source: str | MemberSpec, **options: Any) -> Member:
        """Load a member from an alias, a directory, a GGUF file or a hub id (cached per process)."""
        spec = source if isinstance(source, MemberSpec) else MemberSpec(source=str(source), **options)
        model, tokenizer = load_objects(spec)
        name = spec.name or (str(spec.source) if spec.source in BUNDLED else Path(str(spec.source)).name or str(spec.source))
        return cls(model, tokenizer, name=name, chat_template=spec.chat_template)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---------------------------------------------------------------- properties
    @functools.cached_property
    def eos_id_tensor(self) -> torch.Tensor:
        """:attr:`eos_token_ids` as a sorted index tensor (to sum a distribution's end-of-text mass)."""
        return torch.tensor(sorted(self.eos_token_ids), dtype=torch.long)

    @property
    def device(self) -> torch.device:
        """Where input ids go (the first device under a device map)."""
        return self.model.device

    @property
    def context_window(self) -> int:
        cfg = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return int(getattr(self.tokenizer, "model_max_length", 2048))

    def __repr__(self) -> str:
        return f"Member({self.name!r}, device={self.device}, vocab={self.vocab_size})"

    # ---------------------------------------------------------------- text ↔ ids
    @property
    def native_tools(self) -> bool:
        """Whether this member's chat template renders tools itself (else they go into the system prompt)."""
        return template_supports_tools(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def messages(self, prompt: Prompt, structured: StructuredRequest | None = None) -> list[dict[str, Any]]:
        """The normalised conversation as this member sees it (with tool / schema instructions)."""
        messages = normalize_messages(prompt)
        return with_instructions(messages, structured, self.native_tools) if structured and structured.active else messages

    def render(self, prompt: Prompt, structured: StructuredRequest | None = None) -> str:
        """The prompt as this member's own chat-formatted text, ending in the generation prompt."""
        tools = list(structured.tools) if structured and structured.tools and structured.choice != "none" else None
        return render_chat(self.tokenizer, self.messages(prompt, structured), self.chat_template,
                           tools=[{"type": "function", "function": t} for t in tools] if tools else None)

    def response_lead(self, prompt: Prompt, structured: StructuredRequest | None = None) -> str:
        """Whitespace this member's chat format puts before a reply (see :func:`chat.reply_lead`)."""
        return reply_lead(self.tokenizer, self.messages(prompt, structured), self.chat_template)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered prompt; BOS is added once, where the tokenizer wants it."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return alignment.decode(self.tokenizer, ids)

    def tokenize(self, text: str) -> alignment.Tokenized:
        return alignment.tokenize(self.tokenizer, text)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---------------------------------------------------------------- decoding
    def start(self, prompt: Prompt, max_new_tokens: int = 0, structured: StructuredRequest | None = None) -> DecodeState:
        """A fresh decoding state for ``prompt`` (nothing is computed until :meth:`DecodeState.score`)."""
        ids = self.encode_prompt(self.render(prompt, structured))
        if len(ids) + max_new_tokens > self.context_window:
            raise PromptTooLongError(self.name, len(ids), max_new_tokens, self.context_window)
        return DecodeState(self, ids)

    def start_from_ids(self, ids: Sequence[int]) -> DecodeState:
        if len(ids) == 0:
            raise InputError(f"Member {self.name!r} needs at least one prompt token to start decoding.")
        return DecodeState(self, list(ids))


@dataclass
class DecodeStats:
    """Work done by one member for one request."""

    forward_passes: int = 0
    tokens_fed: int = 0
    seconds: float = 0.0
    reprefills: int = 0


class DecodeState:
    """One member's incremental decoding state: token ids and a KV cache over them.

    Invariant: ``cache`` holds the first ``cached`` ids; ``ids[cached:]`` are *pending*
    (appended, not yet run). ``_last_row`` holds the next-token logits after the last
    cached id, so a round that appends nothing needs no forward pass.
    """

    def __init__(self, member: Member, prompt_ids: list[int]) -> None:
        self.member = member
        self.ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.cache = new_cache(member.model)
        self.cached = 0
        self._fed_since_crop = 0
        self._last_row: torch.Tensor | None = None
        self.stats = DecodeStats()
        #: The batcher of the request that created this state (None: every pass runs alone);
        #: see :mod:`ensemble_core.batching`.
        self.batch: batching.Binding | None = batching.current()

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def score(self, new_ids: Sequence[int] = ()) -> torch.Tensor:
        """Append ``new_ids`` and return next-token logits, shape ``[len(new_ids) + 1, V]``.

        Row ``j`` is the distribution after ``ids_before + new_ids[:j]``: row 0 predicts
        the first new token, the last row predicts the token after all of them. Only the
        pending tail is run through the model (one forward pass).
        """
        self.ids.extend(int(i) for i in new_ids)
        pending = self.ids[self.cached:]
        want = len(new_ids) + 1
        if not pending:
            assert self._last_row is not None
            return self._last_row.unsqueeze(0)
        reuse_last = len(pending) < want  # nothing pending before new_ids: row 0 is cached
        if reuse_last and self._last_row is None:
            raise InputError(f"Member {self.member.name!r} has no context to score from.")
        t0 = time.perf_counter()
        keep = min(len(pending), want)
        rows = batching.run_job(self.batch, self.member, self._job(pending, keep))
        if reuse_last:
            rows = torch.cat([self._last_row.to(rows.device).unsqueeze(0), rows], dim=0)
        self.cached = len(self.ids)
        self._fed_since_crop += len(pending)
        self._last_row = rows[-1]
        self.stats.forward_passes += 1
        self.stats.tokens_fed += len(pending)
        self.stats.seconds += time.perf_counter() - t0
        return rows

    def _job(self, pending: list[int], keep: int) -> batching.Job:
        """The forward pass of ``pending`` on this state's cache, keeping the last ``keep`` rows."""
        model, device, cache = self.member.model, self.member.device, self.cache

        def direct() -> torch.Tensor:
            input_ids = torch.tensor([pending], dtype=torch.long, device=device)
            out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep)
            return out.logits[0, -keep:].float()

        return batching.causal_job(cache, pending, range(len(pending) - keep, len(pending)), direct, device)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` ids (``1 <= n <= len``), dropping the rest and their cache.

        Id ``n - 1`` becomes pending again when it was cached, so that the next
        :meth:`score` recomputes the distribution after exactly ``n`` ids.
        """
        if n < 1 or n > len(self.ids):
            raise InputError(f"Cannot crop member {self.member.name!r} to {n} tokens (has {len(self.ids)}).")
        del self.ids[n:]
        if self.cached < n:  # only pending ids were dropped
            return
        if self.cached == n:  # nothing to drop; trim sliding layers back to their window
            if self._fed_since_crop:
                crop(self.cache, 0)
            self._fed_since_crop = 0
            return
        remove = self.cached - (n - 1)
        if can_crop_exactly(self.cache, remove, self._fed_since_crop):
            crop(self.cache, remove)
            self.cached = n - 1
        else:  # sliding window already dropped the states we need: rebuild from scratch
            self.cache = new_cache(self.member.model)
            self.cached = 0
            self.stats.reprefills += 1
        self._fed_since_crop = 0
        self._last_row = None

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append ids without running the model (they are fed on the next :meth:`score`)."""
        self.ids.extend(int(i) for i in new_ids)
