"""Static passes: a member's forward passes in fixed shapes over fixed KV storage, so that a GPU can replay them as CUDA graphs.

Why. On a GPU a small model's pass costs per kernel launch, not per weight: on a lent H200
an eager decode step of the SmolLM2-135M shape and of the Qwen2.5-0.5B shape both took
18-21 ms (docs/gpu.md), and every method's ratio to one member is dominated by that launch
overhead. A CUDA graph launches a whole captured pass at once, but replays fixed addresses
and shapes, so everything a pass touches is fixed here:

* **the KV states live in a slot**: per layer one ``[1, H, max_cache_len, D]`` buffer owned by
  the member and lent to one request's :class:`~ensemble_core.decoding.members.DecodeState`
  at a time (vLLM keeps the KV cache in the model runner too). The state's cache layers are
  prefix views of the slot (:class:`SlotLayer`), so everything that crops or rewinds a cache
  by slicing (``DecodeState.crop``, ``cache_branch``) works unchanged: crop-back is moving the
  write position.
* **a pass of n new tokens runs in the smallest bucket >= n** of :data:`BUCKETS`, padded (vLLM
  captures batch sizes the same way): its new states are written at the write position with
  ``index_copy_`` (positions from a buffer), and attention reads the whole slot through an
  additive mask that shows each query the states before it. Sliding-window layers (Gemma-3)
  keep every state too; their window is in their mask, so a rollback is exact on them as on
  full layers (no re-prefill).
* ids, positions, write positions, the masks and the logits are buffers of the slot's bucket.

Modes (``Member(passes=...)``, ``MemberSpec.passes``): ``"eager"`` (the default: dynamic caches,
:mod:`~ensemble_core.decoding.forward`), ``"static"`` (these passes as ordinary calls: what a CPU
runs, and what the tests compare with eager), ``"graphs"`` (static, and each bucket of each
slot captured as a ``torch.cuda.CUDAGraph`` on its first use, then replayed; CUDA only). What
cannot run static falls back, with the reason in :attr:`StaticPasses.reasons`: a pass longer
than the largest bucket (a prefill) runs at its exact shape, uncaptured; a capture that fails
leaves that bucket uncaptured; a state whose history outgrows its slot leaves it (its layers
grow into ordinary buffers, :class:`~ensemble_core.decoding.cache.InPlaceAppend`) and runs the
eager passes from then on; a member whose head is not a plain ``lm_head`` or that is split over
devices stays eager. Batched passes of a static state run per row (captured batch buckets are
the next step, docs/gpu.md).

"graphs" stays behind this option until a run on a lent GPU shows it gives eager's greedy
tokens and is faster (``tests/gpu_papers.py --passes graphs``): captured code nobody has
replayed must not become a user's default.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from ensemble_core.decoding.cache import RoomyLayer
from ensemble_core.decoding.forward import PLAIN_HEADS, Job
from ensemble_core.decoding.masks import additive_mask, allow_row, layer_types, sliding_window, text_config
from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.loading import check_passes

#: Token counts a static pass is padded to (and, with "graphs", captured at): a decode step,
#: draft and verify windows, packed candidates.
BUCKETS = (1, 2, 4, 8, 16, 32)
#: A slot's length when the member does not say (capped by the model's context window).
DEFAULT_MAX_CACHE_LEN = 4096
#: The shortest span of a slot a pass attends over (spans double up to the slot's length).
MIN_SPAN = 256
#: Eager runs on a side stream before a capture (lazy initialisation inside kernels and
#: allocator warm-up must not be recorded; torch's documented recipe).
WARMUP_RUNS = 2


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``n`` tokens (None: longer than the largest)."""
    return next((b for b in buckets if b >= n), None)


class SlotLayer(RoomyLayer):
    """A cache layer whose states are a prefix of a slot's buffer (every layer type: windows are in the masks).

    It is a :class:`~ensemble_core.decoding.cache.RoomyLayer` that adopted the slot's buffers,
    so a pass that does not run static (the model's own forward) appends into the slot the
    same way, and when the slot is full the layer grows into buffers of its own: the state
    has then left the slot (:meth:`in_slot`).
    """

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.adopt(keys, values, 0)
        self._slot_keys = keys

    def _in_buffer(self) -> bool:
        # an empty prefix has no data pointer to compare: it is in the buffer while the buffer is the slot's
        if self._k is not None and self.keys.dim() == 4 and self.keys.shape[-2] == 0:
            return True
        return super()._in_buffer()

    def in_slot(self) -> bool:
        return self._k is self._slot_keys and self._in_buffer()


class StaticCache(DynamicCache):
    """A request's KV cache on one slot of a member's :class:`StaticPasses` (released when the cache is collected)."""

    runner: StaticPasses
    slot: Slot
    stats: Any = None  # the owning state's DecodeStats (static_passes, graph_replays)

    def in_slot(self) -> bool:
        return all(isinstance(layer, SlotLayer) and layer.in_slot() for layer in self.layers)


@dataclass(eq=False)
class Bucket:
    """The fixed inputs and outputs of passes of ``k`` tokens over a slot's first ``span`` states, and their graph."""

    span: int
    ids: torch.Tensor  # [1, k]
    positions: torch.Tensor  # [1, k]
    write: torch.Tensor  # [k]: the slot positions the new states go to
    masks: dict[str, torch.Tensor]  # per layer type, [1, 1, k, span] additive
    graph: Any = None
    out: torch.Tensor | None = None  # [k, V] logits the graph writes
    failed: str | None = None  # why this bucket is not captured


@dataclass(eq=False)
class Slot:
    """KV storage for one request: per layer a keys and a values buffer, and the slot's buckets."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    buckets: dict[tuple[int, int], Bucket] = field(default_factory=dict)  # by (tokens, span)
    busy: bool = False


class WriteCache:
    """The cache a static pass hands the model: new states go to the write positions, attention reads the whole slot."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], write: torch.Tensor) -> None:
        self.keys, self.values, self.write = keys, values, write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.write, key_states)
        v.index_copy_(2, self.write, value_states)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("a static pass gives the model its position ids; nothing may size it by the cache")


@dataclass(frozen=True)
class KVShape:
    """What a slot holds per layer: ``layers`` x ``[1, heads, length, head_dim]`` of ``dtype`` on ``device``."""

    layers: int
    heads: int
    head_dim: int
    length: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes(self) -> int:
        return 2 * self.layers * self.heads * self.length * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()


def span_sizes(length: int, shortest: int = MIN_SPAN) -> tuple[int, ...]:
    """Spans a slot of ``length`` is read in: doubling from ``shortest``, then the whole slot."""
    spans, span = [], shortest
    while span < length:
        spans.append(span)
        span *= 2
    return (*spans, length)


def kv_shape(model: Any, max_cache_len: int) -> KVShape:
    """A slot's shape for ``model`` (from its config; a pass checks it against the model's own states)."""
    cfg = text_config(model)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    return KVShape(int(cfg.num_hidden_layers), heads, head_dim, max_cache_len, dtype, model.device)


def unsupported_reason(model: Any, mode: str) -> str | None:
    """Why ``model`` cannot run static passes (None: it can)."""
    if type(model).__name__ not in PLAIN_HEADS or getattr(model, "model", None) is None \
            or getattr(model, "lm_head", None) is None:
        return f"{type(model).__name__} is not one of the plain-head models static passes know ({', '.join(PLAIN_HEADS)})"
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        return f"the model is split over devices ({', '.join(sorted(devices))})"
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        return f"attention {impl!r} ignores the additive masks static passes need (use 'sdpa')"
    return None


class StaticPasses:
    """A member's static passes: its slots, its buckets' buffers and graphs, and why anything fell back.

    One per :class:`~ensemble_core.decoding.members.Member`. Passes of one member are
    serialised by a lock (the slots' bucket buffers are shared by every pass of a bucket).
    """

    def __init__(self, model: Any, mode: str = "static", max_cache_len: int | None = None, slots: int = 4,
                 buckets: Sequence[int] = BUCKETS) -> None:
        check_passes(mode)
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < max(buckets) + 1):
            raise InvalidOptionError("max_cache_len", max_cache_len, f"an int of at least {max(buckets) + 1}")
        if not isinstance(slots, int) or slots < 1:
            raise InvalidOptionError("slots", slots, "an int >= 1")
        self.model = model
        self.mode = mode
        self.buckets = tuple(sorted(buckets))
        cfg = text_config(model)
        window = int(getattr(cfg, "max_position_embeddings", 0) or DEFAULT_MAX_CACHE_LEN)
        self.shape = kv_shape(model, max_cache_len or min(window, DEFAULT_MAX_CACHE_LEN))
        self.max_slots = slots
        self.spans = span_sizes(self.shape.length)
        self.types = layer_types(model)
        self.window = sliding_window(model)
        #: why a part fell back: {"static": ...} (the member stays eager), {"graphs": ...}, {"bucket 8": ...}
        self.reasons: dict[str, str] = {}
        self.counts = {"static": 0, "replays": 0, "captures": 0, "fallbacks": 0}
        self._slots: list[Slot] = []
        self._lock = threading.RLock()
        self._pool: Any = None
        reason = unsupported_reason(model, mode)
        if reason:
            self.reasons["static"] = reason
        if mode == "graphs" and self.shape.device.type != "cuda":
            self.reasons["graphs"] = f"the member is on {self.shape.device.type} (CUDA graphs need a CUDA device)"

    @property
    def usable(self) -> bool:
        return self.mode != "eager" and "static" not in self.reasons

    @property
    def capturing(self) -> bool:
        return self.usable and self.mode == "graphs" and "graphs" not in self.reasons

    # ---------------------------------------------------------------- slots
    def new_cache(self, prompt_len: int = 0) -> StaticCache | None:
        """A cache on a free slot (None: static passes are off, every slot is lent, or the prompt fills half a slot)."""
        if not self.usable or prompt_len * 2 > self.shape.length:
            return None
        with self._lock:
            slot = next((s for s in self._slots if not s.busy), None)
            if slot is None:
                if len(self._slots) >= self.max_slots:
                    return None
                slot = self._new_slot()
                self._slots.append(slot)
            slot.busy = True
        cache = StaticCache()
        cache.layers = []
        for k, v in zip(slot.keys, slot.values):
            layer = SlotLayer()
            layer.bind(k, v)
            cache.layers.append(layer)
        cache.runner, cache.slot = self, slot
        weakref.finalize(cache, _release, slot)
        return cache

    def _new_slot(self) -> Slot:
        s = self.shape
        size = (1, s.heads, s.length, s.head_dim)
        keys = [torch.zeros(size, dtype=s.dtype, device=s.device) for _ in range(s.layers)]
        values = [torch.zeros(size, dtype=s.dtype, device=s.device) for _ in range(s.layers)]
        return Slot(keys, values)

    # ---------------------------------------------------------------- passes
    @torch.inference_mode()
    def run(self, cache: StaticCache, job: Job, eager: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``job``'s logits rows (float ``[len(keep), V]``), its new states written into the slot."""
        with self._lock:
            context, n = int(cache.get_seq_length()), len(job.ids)
            if not cache.in_slot() or context + n > self.shape.length:
                self.counts["fallbacks"] += 1
                return eager()
            k = bucket_for(n, self.buckets)
            replayed = False
            if k is None or context + k > self.shape.length:
                rows = self._exact(cache.slot, job, context)
            else:
                rows, replayed = self._bucketed(cache.slot, job, context, k)
            for layer in cache.layers:
                layer.keys, layer.values = layer._k[:, :, :context + n], layer._v[:, :, :context + n]
            self.counts["static"] += 1
            if cache.stats is not None:
                cache.stats.static_passes += 1
                cache.stats.graph_replays += int(replayed)
            return rows

    def span_for(self, end: int) -> int:
        """How much of the slot a pass that writes up to ``end`` attends over: the smallest span that holds it.

        Why spans: attention over the whole slot would read ``max_cache_len`` states per layer
        on every step (a 135M drafter's KV at 4096 tokens is a third of its weights); spans
        double from :data:`MIN_SPAN`, so a pass reads at most twice the states it needs, for
        a graph per (bucket, span) actually used.
        """
        return next(s for s in self.spans if s >= end)

    def _allowed(self, job: Job, context: int, width: int, span: int, kind: str) -> torch.Tensor:
        """``[width, span]`` visibility of ``job``'s queries: the context before them (their window on
        sliding layers), the job's own block after it; padding queries see themselves."""
        allowed = torch.zeros(width, span, dtype=torch.bool, device=self.shape.device)
        window = self.window if kind == "sliding_attention" else None
        allow_row(allowed, job, 0, 0, context, context, window)
        return allowed

    def _fill(self, bucket: Bucket, job: Job, context: int) -> None:
        """Write ``job`` into the bucket's buffers (ids and positions padded past the job's tokens)."""
        n, k, span = len(job.ids), bucket.ids.shape[1], bucket.span
        device = self.shape.device
        ids = torch.zeros(k, dtype=torch.long)
        ids[:n] = torch.tensor(job.ids, dtype=torch.long)
        bucket.ids[0].copy_(ids.to(device, non_blocking=True))
        pos = job.positions.to(device)
        bucket.positions[0, :n] = pos
        if k > n:
            bucket.positions[0, n:] = pos[-1] + 1 + torch.arange(k - n, device=device)
        bucket.write.copy_(context + torch.arange(k, device=device))
        for kind, mask in bucket.masks.items():
            mask.copy_(additive_mask(self._allowed(job, context, k, span, kind)[None], self.shape.dtype))

    def _bucket(self, slot: Slot, k: int, span: int) -> Bucket:
        bucket = slot.buckets.get((k, span))
        if bucket is None:
            s = self.shape
            masks = {kind: torch.zeros(1, 1, k, span, dtype=s.dtype, device=s.device)
                     for kind in dict.fromkeys(self.types)}
            bucket = slot.buckets[k, span] = Bucket(span, torch.zeros(1, k, dtype=torch.long, device=s.device),
                                                    torch.zeros(1, k, dtype=torch.long, device=s.device),
                                                    torch.zeros(k, dtype=torch.long, device=s.device), masks)
        return bucket

    def _forward(self, slot: Slot, span: int, ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                 masks: dict[str, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """The model's body over the slot's first ``span`` states and its head on ``rows`` of the pass
        (None: all): ``[rows, V]`` logits."""
        cache = WriteCache([k[:, :, :span] for k in slot.keys], [v[:, :, :span] for v in slot.values], write)
        mask: Any = next(iter(masks.values())) if len(masks) == 1 else dict(masks)  # as verify-in-line hands them
        hidden = self.model.model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                                  position_ids=positions).last_hidden_state[0]
        logits = self.model.lm_head(hidden if rows is None else hidden[rows])
        cap = getattr(text_config(self.model), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _bucketed(self, slot: Slot, job: Job, context: int, k: int) -> tuple[torch.Tensor, bool]:
        bucket = self._bucket(slot, k, self.span_for(context + k))
        self._fill(bucket, job, context)

        def run() -> torch.Tensor:
            return self._forward(slot, bucket.span, bucket.ids, bucket.positions, bucket.write, bucket.masks)

        if bucket.graph is None and bucket.failed is None and self.capturing:
            self._capture(bucket, run)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.counts["replays"] += 1
            out = bucket.out
        else:
            out = run()
        assert out is not None
        index = torch.tensor(job.keep, dtype=torch.long, device=out.device)
        return out.index_select(0, index).float(), bucket.graph is not None

    def _capture(self, bucket: Bucket, run: Callable[[], torch.Tensor]) -> None:
        """Record ``run`` (the bucket's pass, inputs already filled) as a CUDA graph; on failure say why and stay eager.

        The warm-up runs and the capture see the pass's real inputs, so what they write into
        the slot is what the replay that follows writes again. Every graph of the member
        shares one memory pool (they never run at the same time: the lock).
        """
        try:
            device = self.shape.device
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    run()
            torch.cuda.current_stream(device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = run()
            bucket.graph, bucket.out = graph, out
            self.counts["captures"] += 1
        except Exception as exc:  # a capture that fails costs this bucket its graph, never the request
            bucket.failed = f"{type(exc).__name__}: {exc}"
            self.reasons[f"bucket {bucket.ids.shape[1]}x{bucket.span}"] = bucket.failed

    def _exact(self, slot: Slot, job: Job, context: int) -> torch.Tensor:
        """A pass at its own length (longer than every bucket: a prefill): static writes, no padding, no graph."""
        device, n = self.shape.device, len(job.ids)
        ids = torch.tensor([job.ids], dtype=torch.long, device=device)
        positions = job.positions.to(device)[None]
        write = context + torch.arange(n, device=device)
        masks = {kind: additive_mask(self._allowed(job, context, n, context + n, kind)[None], self.shape.dtype)
                 for kind in dict.fromkeys(self.types)}
        rows = torch.tensor(job.keep, dtype=torch.long, device=device)
        return self._forward(slot, context + n, ids, positions, write, masks, rows).float()


def _release(slot: Slot) -> None:
    slot.busy = False


def route(job: Job) -> Job:
    """``job`` with its direct call running static when its cache is on a slot; the eager call stays the fallback.

    Every pass of a :class:`~ensemble_core.decoding.members.DecodeState` is built as a
    :class:`~ensemble_core.decoding.forward.Job` and goes through here, alone or batched.
    """
    cache = job.cache
    if isinstance(cache, StaticCache):
        eager = job.direct
        job.direct = lambda: cache.runner.run(cache, job, eager)
    return job
