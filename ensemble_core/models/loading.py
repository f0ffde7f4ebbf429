"""Loading a member's model and tokenizer: from an alias, a directory, a GGUF file or a hub id.

:class:`MemberSpec` says what to load and where (dtype, device, quantization, prepacking);
:func:`load_objects` loads it once per process (weights are shared by every ensemble that
names the same spec). Hub look-ups fail fast when the hub cannot be reached, and a near-miss
of a bundled alias fails at once with a suggestion. This module knows nothing about
decoding: :class:`~ensemble_core.decoding.members.Member` wraps what it loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import gc
import os
import platform
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from ensemble_core.errors import (
    ConfigurationError,
    InvalidOptionError,
    MissingDependencyError,
    ModelLoadError,
    UnknownAliasError,
    UnknownOptionError,
)
from ensemble_core.models.bundled import BUNDLED, convert_gguf
from ensemble_core.models.products import available_memory, should_prepack, use_cpu_products
from ensemble_core.models.quantize import check_scheme, quantize
from ensemble_core.options import check_bool

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


#: Tokens of recent prompts a member keeps the KV states of (:attr:`MemberSpec.prefix_cache`): a few agent
#: conversations' worth (their prompts are ~400-800 tokens with tools); per token a float32 SmolLM2-135M holds
#: 46 KB, Qwen2.5-0.5B 25 KB, a bfloat16 7-8B member 57-131 KB.
DEFAULT_PREFIX_CACHE = 4096


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
    on a CPU, different greedy outputs (see :mod:`ensemble_core.models.quantize`). ``prepack``: a
    float32 member on a CPU also keeps its linear weights in oneDNN's blocked layout, which
    makes passes of several tokens (verify windows, packed candidates, batched steps,
    prefill) 1.2-2x faster with the same values, for a second copy of those weights in
    memory: None (default) does it when the copy fits easily in the memory available at
    load, True / False decide (see :mod:`ensemble_core.models.products`). ``passes``: how the
    member's forward passes run: ``"eager"`` (default), ``"static"`` (fixed shapes over a
    preallocated KV slot of ``max_cache_len`` tokens) or ``"graphs"`` (static, replayed as CUDA
    graphs; experimental until measured on a GPU). See :mod:`ensemble_core.decoding.static`.
    ``prefix_cache``: how many tokens of its recent prompts' KV states a member keeps, so that a
    request that starts like one of them (an agent's next turn, a chat's next message) prefills only
    what is new (0: none; see :mod:`ensemble_core.decoding.prefix_cache`).
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
    passes: str = "eager"
    max_cache_len: int | None = None
    prefix_cache: int = DEFAULT_PREFIX_CACHE

    def __post_init__(self) -> None:
        if not isinstance(self.source, (str, os.PathLike)) or not str(self.source).strip():
            raise InvalidOptionError("source", self.source, "an alias, a path or a model id")
        if self.device is not None and self.device_map is not None:
            raise InvalidOptionError("device_map", self.device_map, "None when device is given (pass one of them)")
        if not ((isinstance(self.dtype, str) and (self.dtype == "auto" or self.dtype in _DTYPES))
                or (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point)):
            raise InvalidOptionError("dtype", self.dtype, "'auto', 'float32', 'float16', 'bfloat16' or a floating torch.dtype")
        if self.device_map is not None and not isinstance(self.device_map, (str, dict)):
            raise InvalidOptionError("device_map", self.device_map, "None, a string such as 'auto' or a dict of module "
                                     "names to devices")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template.strip()):
            raise InvalidOptionError("chat_template", self.chat_template, "None (the tokenizer's template) or a Jinja "
                                     "template string")
        if self.chat_template is not None:
            check_template(self.chat_template)
        if self.attn_implementation is not None and (not isinstance(self.attn_implementation, str)
                                                     or not self.attn_implementation):
            raise InvalidOptionError("attn_implementation", self.attn_implementation, "None or a name such as 'sdpa' "
                                     "or 'eager'")
        check_bool("trust_remote_code", self.trust_remote_code)
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                raise InvalidOptionError("device", self.device, "a torch device string such as 'cpu' or 'cuda:0'") from exc
        check_scheme(self.quantize, _resolve_dtype(self.dtype, self.device), self.device, self.device_map)
        check_bool("prepack", self.prepack, "None (when it fits in memory), True or False", optional=True)
        check_passes(self.passes)
        if self.max_cache_len is not None and (isinstance(self.max_cache_len, bool)
                                               or not isinstance(self.max_cache_len, int) or self.max_cache_len < 64):
            raise InvalidOptionError("max_cache_len", self.max_cache_len, "None or an int >= 64 (tokens per slot)")
        check_prefix_cache(self.prefix_cache)


def check_template(template: str) -> None:
    """Compile a ``chat_template`` override now, as transformers compiles it for ``apply_chat_template`` (its
    sandbox and extensions, ``{% generation %}`` included): a syntax error is the spec's, not every request's."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise InvalidOptionError("chat_template", template[:80] + ("..." if len(template) > 80 else ""),
                                 f"a Jinja template that parses (line {exc.lineno}: {exc.message})") from exc


def member_spec(source: Any, options: Mapping[str, Any]) -> MemberSpec:
    """``MemberSpec(source, **options)`` (a ``MemberSpec`` source: that spec with ``options`` replaced) with the
    options' names checked (a typo or a misplaced ``source`` is a typed error naming the accepted fields, not a
    ``TypeError`` from the dataclass)."""
    known = {f.name for f in dataclasses.fields(MemberSpec)} - {"source"}
    unknown = set(options) - known
    if "source" in unknown:
        raise ConfigurationError("member_options cannot set 'source': each member's source is its entry in members=[...].")
    if unknown:
        raise UnknownOptionError(unknown, "MemberSpec (member_options)", known)
    if source is None:
        raise ConfigurationError("A member given as a dict needs its 'source' (an alias, a path or a model id).")
    if isinstance(source, MemberSpec):
        return dataclasses.replace(source, **options)
    return MemberSpec(source=source, **options)


def spec_of_dict(item: Mapping[str, Any], options: Mapping[str, Any]) -> MemberSpec:
    """A member given as a dict of :class:`MemberSpec` fields, over the ensemble's ``member_options``."""
    return member_spec(item.get("source"), {**options, **{k: v for k, v in item.items() if k != "source"}})


def check_prefix_cache(tokens: Any) -> int:
    """``tokens`` when it is a valid :attr:`MemberSpec.prefix_cache` budget (an int >= 0), else a typed error."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidOptionError("prefix_cache", tokens, "an int >= 0 (tokens of recent prompts kept per member; 0: off)")
    return tokens


#: How a member's forward passes run (:mod:`ensemble_core.decoding.static`).
PASS_MODES = ("eager", "static", "graphs")


def check_passes(mode: Any) -> str:
    """``mode`` when it is one of :data:`PASS_MODES`, else a typed error that lists them."""
    if mode not in PASS_MODES:
        raise InvalidOptionError("passes", mode, " or ".join(repr(m) for m in PASS_MODES))
    return str(mode)


def per_member_options(count: int, dtype: Any = "auto", devices: Sequence[str] = (),
                       quantize: Sequence[str | None] = (), prepack: bool | None = None,
                       passes: str = "eager", prefix_cache: int = DEFAULT_PREFIX_CACHE) -> list[dict[str, Any]]:
    """Load options of ``count`` members from command-line style lists (one value for all, or one per member).

    ``dtype`` is one value or a list (``["float32", "bfloat16"]``: a float32 drafter next to
    a bfloat16 verifier). ``quantize`` values are ``"int8"`` or ``"none"``/None. ``prepack``
    is one value for all (None: when it fits; False: ``--no-prepack``, one copy of the weights), and so
    is ``passes`` (``--passes``: eager, static or graphs) and ``prefix_cache`` (``--prefix-cache``). Shared by
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
        if check_passes(passes) != "eager":
            opts["passes"] = passes
        if check_prefix_cache(prefix_cache) != DEFAULT_PREFIX_CACHE:
            opts["prefix_cache"] = prefix_cache
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


def device_problem(device: str) -> str | None:
    """Why ``device`` (a valid torch device string) cannot hold a member in this process, or None.

    Checked when a member loads, where it loads (a Ray actor's node may have the GPU its driver lacks), and
    before the weights are read: torch would fail only in ``model.to(...)``, after the load, with an
    assertion ("Torch not compiled with CUDA enabled") that names no fix.
    """
    where = torch.device(device)
    if where.type == "cpu":
        return None
    if where.type == "meta":
        return "a meta device holds no weights to compute with"
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != where.type:
        have = f"this torch build's accelerator is {accelerator.type!r}" if accelerator is not None else (
            f"this torch build ({torch.__version__}) sees no accelerator")
        return f"no {where.type!r} device is available: {have}"
    count = torch.accelerator.device_count()
    if where.index is not None and where.index >= count:
        return f"{where.type}:{where.index} does not exist: {count} {where.type} device(s), numbered from 0"
    return None


def _load_objects(spec: MemberSpec) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    problem = None if spec.device is None else device_problem(spec.device)
    if problem is not None:
        raise InvalidOptionError("device", spec.device, f"a device this process has ({problem}); 'cpu' always works")
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


def in_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread that ends with it: its result, or its exception raised here.

    Why: torch's CPU kernels run on OpenMP, and GNU OpenMP keeps a team of helper threads for
    every thread that ever ran a parallel region, until that thread ends. Once the teams hold more
    threads than there are cores, each team's helpers stop spinning between regions and sleep
    (libgomp's "throttled" wait), so every region of a pass waits for its helpers to wake. Loading
    a member (conversion, casting, prepacking) runs parallel regions; done in the caller's thread
    (usually the main one, which never ends), it leaves a team there for good, and the passes of
    every request that then runs in another thread (``ainvoke``, LlamaIndex's async agents:
    ``runtime.Run.astream``) pay that wait. Measured on 2 cores, the bundled SmolLM2,
    48 tokens from a worker thread: 3.73-4.25 s after loading in the main thread, 3.27-3.41 s after
    loading in a thread of its own (docs/configuration.md, "Threads on a CPU").
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ensemble-load") as pool:
        return pool.submit(fn).result()  # the pool's thread ends when the block does; fn's error is raised here


def on_cpu(spec: MemberSpec) -> bool:
    """Whether ``spec``'s weights stay on the CPU (no device, ``"cpu"``, no accelerate placement)."""
    return spec.device_map is None and str(spec.device or "cpu").startswith("cpu")


def load_key(spec: MemberSpec) -> tuple[Any, ...]:
    """The per-process load cache's key: what the options resolve to, not how they are written, so that
    ``dtype="auto"`` / ``"float32"`` / ``torch.float32`` and ``device=None`` / ``"cpu"`` on a CPU share one copy
    of the weights (they loaded one copy each: six of SmolLM2 for six spellings)."""
    device = None if spec.device is not None and str(torch.device(spec.device)) == "cpu" else spec.device
    return (str(spec.source), str(_resolve_dtype(spec.dtype, spec.device)), device, repr(spec.device_map),
            spec.attn_implementation, spec.trust_remote_code, spec.quantize, spec.prepack)


def load_objects(spec: MemberSpec) -> tuple[Any, Any]:
    """Load (or fetch from the per-process cache) a model and tokenizer for ``spec``.

    A CPU member loads in a thread of its own (:func:`in_passing_thread`), so that the caller's thread
    keeps no OpenMP team. A GPU member loads here: the caller's current CUDA device is its own
    (``torch.cuda.set_device``) and would not carry over to another thread."""
    key = load_key(spec)
    with _LOAD_LOCK:
        if key not in _LOADED:
            t0 = time.perf_counter()
            load = functools.partial(_load_objects, spec)
            _LOADED[key] = in_passing_thread(load) if on_cpu(spec) else load()
            LOAD_SECONDS[str(spec.source)] = time.perf_counter() - t0
        return _LOADED[key]


def clear_loaded(unreferenced_only: bool = False) -> None:
    """Forget the models loaded in this process (their memory is freed once nothing else holds them).

    ``unreferenced_only``: forget only the models nothing else holds (a member, an ensemble). A model still
    in use stays cached: forgetting it frees nothing, and the next load of it would make a second copy
    instead of sharing the first.
    """
    with _LOAD_LOCK:
        if not unreferenced_only:
            _LOADED.clear()
            return
        held = {key: (weakref.ref(model), tokenizer) for key, (model, tokenizer) in _LOADED.items()}
        _LOADED.clear()
        gc.collect()  # a model's modules refer to each other: only a collection frees an unheld one
        for key, (model_ref, tokenizer) in held.items():
            model = model_ref()
            if model is not None:
                _LOADED[key] = (model, tokenizer)

