"""Static passes: a member's forward passes in fixed shapes over fixed KV storage, so that a GPU can replay them as CUDA graphs.

Why. On a GPU a small model's pass costs per kernel launch, not per weight: on a lent H200
an eager decode step of the SmolLM2-135M shape and of the Qwen2.5-0.5B shape both took
18-21 ms (docs/gpu.md), and every method's ratio to one member is dominated by that launch
overhead. A CUDA graph launches a whole captured pass at once, but replays fixed addresses
and shapes, so everything a pass touches is fixed here:

* **the KV states live in a slot**: the member owns, per layer, one ``[slots, H, max_cache_len, D]``
  buffer (its :class:`Pool`; vLLM keeps the KV cache in the model runner too), and lends row
  ``i`` of it to one request's :class:`~ensemble_core.decoding.members.DecodeState` at a time.
  The state's cache layers are prefix views of its row (:class:`SlotLayer`), so everything that
  crops or rewinds a cache by slicing (``DecodeState.crop``, ``cache_branch``) works unchanged:
  crop-back is moving the write position. The last 32 positions of every row (the largest
  bucket) are scratch, where the padding rows of a batched pass write.
* **a pass of n new tokens runs in the smallest bucket >= n** of :data:`BUCKETS`, padded (vLLM
  captures batch sizes the same way): its new states are written at positions held in a
  buffer, and attention reads a span of the slot (:meth:`StaticPasses.span_for`) through an
  additive mask that shows each query the states before it. Sliding-window layers (Gemma-3)
  keep every state too; their window is in their mask, so a rollback is exact on them as on
  full layers (no re-prefill).
* **every pass of up to 32 tokens runs over the first R rows of the pool** (R = 1, 2, 4, 8, 16:
  the smallest that holds the slots in it): one request's pass (R = 1 on slot 0, where a lone
  request decodes) and the scheduler's group of several requests' jobs alike. Rows not in the
  pass are padding; the pool is the batch, nothing is gathered or scattered, and each row
  writes its new states at its own positions (``index_put_``). So a member captures one graph
  per (rows, tokens, span) it used, whichever slots ran them.
* **the host hands a pass over in one copy**: ids, positions, write positions, each row's
  context length and the new tokens' visibility are one flat buffer of the bucket
  (:func:`host_inputs` builds it on the host in a few ops, whatever the rows;
  :func:`~ensemble_core.transfer.to_device` copies it without a stream sync), and
  the masks are computed from it inside the pass
  (:func:`~ensemble_core.decoding.masks.slot_allowed`), so a replay launches nothing per row.
  The logits are a buffer of the bucket too.

Modes (``Member(passes=...)``, ``MemberSpec.passes``): ``"eager"`` (the default: dynamic caches,
:mod:`~ensemble_core.decoding.forward`), ``"static"`` (these passes as ordinary calls: what a CPU
runs, and what the tests compare with eager), ``"graphs"`` (static, and each (rows, tokens,
span) captured as a ``torch.cuda.CUDAGraph`` on its first use, then replayed; CUDA only). What
cannot run static falls back, with the reason in :attr:`StaticPasses.reasons`: a pass longer
than the largest bucket (a prefill) runs at its exact shape, uncaptured; a capture that fails
leaves that bucket uncaptured; a state whose history outgrows its slot leaves it (its layers
grow into ordinary buffers, :class:`~ensemble_core.decoding.cache.InPlaceAppend`) and runs the
eager passes from then on; a member whose head is not a plain ``lm_head`` or that is split over
devices stays eager; the scheduler runs a group's rows on the pool apart from its eager rows.

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
from ensemble_core.decoding.forward import PLAIN_HEADS, Job, place_device_ids
from ensemble_core.decoding.masks import (
    MASK_HONOURING_ATTENTION,
    additive_mask,
    layer_types,
    sliding_window,
    slot_allowed,
    text_config,
)
from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.loading import check_passes
from ensemble_core.transfer import HOST, fill, to_device

#: Token counts a static pass is padded to (and, with "graphs", captured at): a decode step,
#: draft and verify windows, packed candidates.
BUCKETS = (1, 2, 4, 8, 16, 32)
#: Row counts a batched pass is padded to (vLLM captures the same batch sizes).
ROW_BUCKETS = (1, 2, 4, 8, 16)
#: A slot's length when the member does not say (capped by the model's context window).
DEFAULT_MAX_CACHE_LEN = 4096
#: The shortest span of a slot a pass attends over (spans double up to the slot's length).
MIN_SPAN = 256
#: Slots per member: up to 16 concurrent requests on a GPU (vLLM batches that many and more), as
#: many as fit in :data:`POOL_MEMORY_SHARE` of its free memory; on a CPU, where every pool row
#: costs memory and a padded row costs compute, 4.
DEFAULT_SLOTS = {"cuda": 16, "other": 4}
POOL_MEMORY_SHARE = 0.25
#: Eager runs on a side stream before a capture (lazy initialisation inside kernels and
#: allocator warm-up must not be recorded; torch's documented recipe).
WARMUP_RUNS = 2


#: One request's part of a pass: its pool row, its job, its cached context.
Placed = tuple[int, Job, int]


def bucket_for(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket that holds ``n`` (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def span_sizes(length: int, shortest: int = MIN_SPAN) -> tuple[int, ...]:
    """Spans a slot of ``length`` is read in: doubling from ``shortest``, then the whole slot."""
    spans, span = [], shortest
    while span < length:
        spans.append(span)
        span *= 2
    return (*spans, length)


def row_sizes(slots: int) -> tuple[int, ...]:
    """Row counts of batched passes over a pool of ``slots`` rows."""
    return (*(b for b in ROW_BUCKETS if b < slots), slots)


class SlotLength:
    """The length of every layer of one :class:`StaticCache` while they hold the same one (``shared``).

    Why (#38): a static pass checks that its row's states are in their slot and then moves them
    forward; done layer by layer that was ~60 Python calls per request and pass for a 30-layer member
    (a third of the host's calls per token of 16 concurrent requests). While only static passes move
    the states, every layer reads its length here (:class:`SlotLayer`), so the check and the move are one
    attribute each. A layer whose length is set any other way (an eager append, a crop, a branch's
    rewind) takes its own length from then on and the lengths stop being shared, until the next static
    pass finds every layer in its slot at one length again. ``epoch`` tells the layers that read ``n``
    (theirs equals it) from those that left.
    """

    __slots__ = ("n", "shared", "epoch")

    def __init__(self) -> None:
        self.n = 0
        self.shared = False
        self.epoch = 0


class _LayerLength:
    """A :class:`SlotLayer`'s ``_kn`` or ``_vn``: its cache's shared length while it reads it, else its own
    (``own``); setting it makes it the layer's own."""

    def __init__(self, own: str) -> None:
        self.own = own

    def __get__(self, layer: Any, owner: Any = None) -> Any:
        if layer is None:
            return self
        return layer._length.n if layer._shared() else getattr(layer, self.own)

    def __set__(self, layer: Any, n: int | None) -> None:
        layer._leave()
        setattr(layer, self.own, n)


class SlotLayer(RoomyLayer):
    """A cache layer whose states are a prefix of a slot's buffer (every layer type: windows are in the masks).

    It is a :class:`~ensemble_core.decoding.cache.RoomyLayer` that adopted the slot's buffers,
    so a pass that does not run static (the model's own forward) appends into the slot the
    same way, and when the slot is full the layer grows into buffers of its own: the state
    has then left the slot (:meth:`in_slot`). Like every such layer it holds its states' length
    while they are the buffer's prefix; while its cache's layers share one length (:class:`SlotLength`)
    it reads it there, so a static pass moves every layer at once (:meth:`StaticCache.advance`).
    """

    _length: SlotLength | None = None
    _epoch = -1  # == _length.epoch while the layer reads its length there
    _own_kn: int | None = None
    _own_vn: int | None = None

    def bind(self, keys: torch.Tensor, values: torch.Tensor, length: SlotLength | None = None) -> None:
        self._length = length
        self.adopt(keys, values, 0)
        self._slot_keys = keys

    def in_slot(self) -> bool:
        return self.held() is not None and self._k is self._slot_keys

    def _shared(self) -> bool:
        length = self._length
        return length is not None and self._epoch == length.epoch

    def _leave(self) -> None:
        """Take the shared length as this layer's own, and stop the cache's layers from sharing one."""
        if self._shared():
            assert self._length is not None
            self._own_kn = self._own_vn = self._length.n
            self._epoch = -1
            self._length.shared = False

    _kn = _LayerLength("_own_kn")  # type: ignore[assignment]
    _vn = _LayerLength("_own_vn")  # type: ignore[assignment]


@dataclass(eq=False)
class Bucket:
    """The fixed inputs and outputs of passes of ``R`` rows x ``k`` tokens over ``span`` states, and their graph.

    ``inputs`` is one flat buffer (:func:`split_inputs`: ids, positions, write positions, each
    row's context length, the new tokens' visibility), so that the host fills a pass with one
    copy; the masks are computed from it inside the pass (:func:`~ensemble_core.decoding.masks.slot_allowed`).
    """

    span: int
    inputs: torch.Tensor  # flat int64, see split_inputs
    rows: torch.Tensor  # [R, k]: the pool row of every new state
    graph: Any = None
    out: torch.Tensor | None = None  # [R, k, V] logits the graph writes
    failed: str | None = None  # why this bucket is not captured

    @property
    def rows_n(self) -> int:
        return int(self.rows.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.rows.shape[1])

    @property
    def key(self) -> str:
        return f"{self.rows_n}x{self.tokens}x{self.span}"


def inputs_size(r: int, k: int) -> int:
    """Length of the flat inputs of a pass of ``r`` rows x ``k`` tokens."""
    return 3 * r * k + r + r * k * k


def split_inputs(flat: torch.Tensor, r: int, k: int) -> tuple[torch.Tensor, ...]:
    """Views of a pass's flat inputs: ids, positions, write positions (``[R, k]`` each), context
    lengths (``[R]``), visibility of the new tokens among themselves (``[R, k, k]``, 0/1)."""
    ids, positions, write, context, block = flat.split([r * k, r * k, r * k, r, r * k * k])
    return ids.view(r, k), positions.view(r, k), write.view(r, k), context, block.view(r, k, k)


def host_inputs(placed: Sequence[Placed], r: int, k: int, scratch: int) -> torch.Tensor:
    """The flat inputs (on the host) of a pass of ``r`` rows x ``k`` tokens holding the ``placed`` jobs.

    A job's row: its ids then zeros, its positions continued past its last one, write
    positions right after its context, its ``block`` with each padding query seeing itself.
    A row without a job (padding) writes at ``scratch ..`` (the slots' scratch tail) and sees
    column 0 only (context 1, every query at position 0, no new token visible): never an empty
    softmax, even within a sliding window, whose NaNs would reach the scratch tail that a
    full-length span reads (masked, but NaN times 0 is NaN).

    Why it is built as one Python list, then a few tensor ops whatever the rows (#38): the host's
    work per batched pass is paid once per step by every request sharing it; building the rows
    one tensor op at a time cost ~33 us per row on a CPU (16 rows: ~0.55 ms a pass, about what a
    graphed 1B pass of 16 rows computes). A causal job's positions are a range from its start and its
    window is lower-triangular: both go into the list; only a packed job's layout (verify-in-line) is
    placed with tensor ops.
    """
    rk, kk = r * k, k * k
    at_pos, at_write, at_context, at_block = rk, 2 * rk, 3 * rk, 3 * rk + r
    flat = [0] * (at_block + r * kk)
    flat[at_write:at_context] = [scratch + j for _ in range(r) for j in range(k)]
    flat[at_context:at_block] = [1] * r
    packed: list[tuple[int, Job]] = []  # (row, job) of jobs with a layout of their own
    for row, job, ctx in placed:
        n, base = len(job.ids), row * k
        flat[base:base + n] = job.ids
        flat[at_write + base:at_write + base + k] = range(ctx, ctx + k)
        flat[at_context + row] = ctx
        square = at_block + row * kk
        for i in range(n, k):  # padding queries see themselves
            flat[square + i * k + i] = 1
        if not job.causal:
            packed.append((row, job))
            continue
        flat[at_pos + base:at_pos + base + k] = range(job.start, job.start + k)  # continued past its last
        for i in range(n):
            flat[square + i * k:square + i * k + i + 1] = [1] * (i + 1)
    out = torch.tensor(flat, dtype=torch.long)
    for row, job in packed:
        n, base = len(job.ids), row * k
        positions, visible = job.layout()
        positions = positions.to(HOST, torch.long)
        out[at_pos + base:at_pos + base + n] = positions
        out[at_pos + base + n:at_pos + base + k] = positions[-1] + torch.arange(1, k - n + 1)
        out[at_block + row * kk:at_block + (row + 1) * kk].view(k, k)[:n, :n] = visible.to(HOST)
    return out


def kept_rows(out: torch.Tensor, placed: Sequence[tuple[int, list[int]]], k: int) -> list[torch.Tensor]:
    """Each job's kept positions of a pass's ``[R, k, V]`` logits (``placed``: its row and positions), as float
    copies (the next replay of the bucket reuses ``out``): one gather for every row, or, for one job keeping
    a run of positions (a lone request's step), a slice: no index to build and copy per token."""
    if len(placed) == 1:
        row, keep = placed[0]
        if keep and keep == list(range(keep[0], keep[0] + len(keep))):
            return [out[row, keep[0]:keep[0] + len(keep)].to(torch.float32, copy=True)]  # a float32 out too
    wanted = [row * k + i for row, keep in placed for i in keep]
    picked = out.flatten(0, 1).index_select(0, to_device(wanted, out.device)).float()
    return list(picked.split([len(keep) for _, keep in placed]))


@dataclass(eq=False)
class Slot:
    """Row ``index`` of the pool: per layer a ``[1, H, L, D]`` keys and values view."""

    index: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    busy: bool = False


@dataclass(eq=False)
class Pool:
    """Every slot's KV states of one member: per layer a ``[slots, H, L, D]`` keys and values buffer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slots: list[Slot]
    buckets: dict[tuple[int, int, int], Bucket] = field(default_factory=dict)  # by (rows, tokens, span)


class StaticCache(DynamicCache):
    """A request's KV cache on one slot of a member's :class:`StaticPasses` (released when the cache is collected)."""

    runner: StaticPasses
    slot: Slot
    stats: Any = None  # the owning state's DecodeStats (static_passes, graph_replays)

    length: SlotLength

    def in_slot(self) -> bool:
        """Whether every layer's states are a prefix of its slot (a static pass may run on them)."""
        if self.length.shared:
            return True
        if not all(isinstance(layer, SlotLayer) and layer.in_slot() for layer in self.layers):
            return False
        held = {layer.held() for layer in self.layers}
        if len(held) == 1:
            self._share(held.pop())  # type: ignore[arg-type]
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """transformers' length of layer ``layer_idx``: the shared one, read at once, while the layers share it
        (a pass asks it twice per request and step)."""
        if self.length.shared:
            return self.length.n
        return super().get_seq_length(layer_idx)

    def advance(self, length: int) -> None:
        """Every layer now holds ``length`` states of its slot (a static pass wrote them there)."""
        if self.length.shared:
            self.length.n = length
            return
        for layer in self.layers:
            layer.expose(length)
        self._share(length)

    def load(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], n: int) -> None:
        """Hold the first ``n`` of ``keys`` / ``values`` (per layer ``[1, H, >= n, D]``: a prefix cache's stored
        prompt, :mod:`~ensemble_core.decoding.prefix_cache`), copied into the slot: the request prefills only
        the rest. Every layer kind takes them all (a sliding window is in the masks)."""
        if len(keys) != len(self.slot.keys) or len(values) != len(self.slot.values):
            raise ValueError(f"{len(keys)} layers of states for a slot of {len(self.slot.keys)}")
        for slot_k, slot_v, k, v in zip(self.slot.keys, self.slot.values, keys, values):
            slot_k[:, :, :n].copy_(k[:, :, :n])
            slot_v[:, :, :n].copy_(v[:, :, :n])
        self.advance(n)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (a negative count of states to drop); one length to move while the layers share it."""
        if self.length.shared and tokens_to_remove <= 0:
            self.length.n = max(self.length.n + tokens_to_remove, 0)
            return
        super().crop(tokens_to_remove)

    def _share(self, n: int) -> None:
        """Every layer reads its length ``n`` from :attr:`length` from now on."""
        length = self.length
        length.epoch += 1
        length.n, length.shared = n, True
        for layer in self.layers:
            layer._epoch = length.epoch


class WriteCache:
    """The cache a static pass hands the model: new states go to the write positions, attention reads ``span`` states.

    ``keys`` / ``values`` are the pool's buffers (``rows[r, j]``, ``write[r, j]``: where row ``r``'s
    ``j``-th new state goes), or one slot's views (``rows`` None: a prefill, every new state of
    the one row to ``write[0]`` along the sequence).
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], write: torch.Tensor,
                 span: int, rows: torch.Tensor | None = None) -> None:
        self.keys, self.values, self.write, self.span, self.rows = keys, values, write, span, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is None:
            k.index_copy_(2, self.write[0], key_states)
            v.index_copy_(2, self.write[0], value_states)
            return k[:, :, :self.span], v[:, :, :self.span]
        k[self.rows, :, self.write] = key_states.transpose(1, 2)
        v[self.rows, :, self.write] = value_states.transpose(1, 2)
        n = key_states.shape[0]
        return k[:n, :, :self.span], v[:n, :, :self.span]

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
        return 2 * self.layers * self.heads * self.length * self.head_dim * self.dtype.itemsize


def kv_shape(model: Any, max_cache_len: int) -> KVShape:
    """A slot's shape for ``model`` (from its config; a pass checks it against the model's own states)."""
    cfg = text_config(model)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    return KVShape(int(cfg.num_hidden_layers), heads, head_dim, max_cache_len, dtype, model.device)


def default_slots(shape: KVShape) -> int:
    """How many slots a member gets when it does not say (see :data:`DEFAULT_SLOTS`)."""
    if shape.device.type != "cuda":
        return DEFAULT_SLOTS["other"]
    free, _ = torch.cuda.mem_get_info(shape.device)
    return max(1, min(DEFAULT_SLOTS["cuda"], int(free * POOL_MEMORY_SHARE) // max(shape.bytes, 1)))


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` cannot run static passes (None: it can)."""
    if type(model).__name__ not in PLAIN_HEADS or getattr(model, "model", None) is None \
            or getattr(model, "lm_head", None) is None:
        return f"{type(model).__name__} is not one of the plain-head models static passes know ({', '.join(PLAIN_HEADS)})"
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        return f"the model is split over devices ({', '.join(sorted(devices))})"
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASK_HONOURING_ATTENTION:
        return f"attention {impl!r} ignores the additive masks static passes need (use 'sdpa')"
    return None


class StaticPasses:
    """A member's static passes: its pool of slots, its buckets' buffers and graphs, and why anything fell back.

    One per :class:`~ensemble_core.decoding.members.Member`. Passes of one member are
    serialised by a lock (buckets are shared by every pass of their shape).
    """

    def __init__(self, model: Any, mode: str = "static", max_cache_len: int | None = None, slots: int | None = None,
                 buckets: Sequence[int] = BUCKETS) -> None:
        check_passes(mode)
        self.buckets = tuple(sorted(buckets))
        self.tail = self.buckets[-1]  # scratch positions at the end of every slot (padding rows write there)
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 2 * self.tail):
            raise InvalidOptionError("max_cache_len", max_cache_len, f"an int of at least {2 * self.tail}")
        self.model = model
        self.mode = mode
        cfg = text_config(model)
        window = int(getattr(cfg, "max_position_embeddings", 0) or DEFAULT_MAX_CACHE_LEN)
        if max_cache_len is not None and max_cache_len > window + self.tail:  # no request fills more: memory for nothing
            raise InvalidOptionError("max_cache_len", max_cache_len, f"an int from {2 * self.tail} to the model's context "
                                     f"window plus {self.tail} scratch positions ({window + self.tail})")
        self.shape = kv_shape(model, max_cache_len or min(window, DEFAULT_MAX_CACHE_LEN))
        if slots is None:
            slots = default_slots(self.shape)
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidOptionError("slots", slots, "an int >= 1")
        self.max_slots = slots
        self.room = self.shape.length - self.tail  # where a request's states may go
        self.spans = span_sizes(self.shape.length)
        self.rows = row_sizes(slots)
        self.types = layer_types(model)
        self.window = sliding_window(model)
        #: why a part fell back: {"static": ...} (the member stays eager), {"graphs": ...}, {"bucket RxKxS": ...}
        self.reasons: dict[str, str] = {}
        self.counts = {"static": 0, "batched": 0, "replays": 0, "captures": 0, "fallbacks": 0}
        self.pool: Pool | None = None
        self._lock = threading.RLock()
        self._graph_pool: Any = None
        reason = unsupported_reason(model)
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
        """A cache on the lowest free slot (None: static passes are off, every slot is lent, or the
        prompt fills half a slot)."""
        if not self.usable or prompt_len * 2 > self.room:
            return None
        with self._lock:
            pool = self.pool = self.pool or self._new_pool()
            slot = next((s for s in pool.slots if not s.busy), None)
            if slot is None:
                return None
            slot.busy = True
        cache = StaticCache()
        cache.layers = []
        cache.length = SlotLength()
        for k, v in zip(slot.keys, slot.values):
            layer = SlotLayer()
            layer.bind(k[:, :, :self.room], v[:, :, :self.room], cache.length)  # an eager append past the room leaves the slot
            cache.layers.append(layer)
        cache._share(0)
        cache.runner, cache.slot = self, slot
        weakref.finalize(cache, _release, slot)
        return cache

    def _new_pool(self) -> Pool:
        s = self.shape
        size = (self.max_slots, s.heads, s.length, s.head_dim)
        keys = [torch.zeros(size, dtype=s.dtype, device=s.device) for _ in range(s.layers)]
        values = [torch.zeros(size, dtype=s.dtype, device=s.device) for _ in range(s.layers)]
        slots = [Slot(i, [k[i:i + 1] for k in keys], [v[i:i + 1] for v in values]) for i in range(self.max_slots)]
        return Pool(keys, values, slots)

    # ---------------------------------------------------------------- passes
    @torch.inference_mode()
    def run(self, job: Job) -> torch.Tensor:
        """``job``'s logits rows (float ``[len(keep), V]``), its new states written into its slot (its eager
        ``direct`` call when the state has left the slot or would outgrow it)."""
        cache = job.cache
        assert isinstance(cache, StaticCache)
        with self._lock:
            context, n = int(cache.get_seq_length()), len(job.ids)
            if not cache.in_slot() or context + n > self.room:
                self.counts["fallbacks"] += 1
                return job.direct()
            k = bucket_for(n, self.buckets)
            if k is None or context + k > self.room:
                rows = self._exact(cache.slot, job, context)
                self._commit([cache], [context], [n], False)
                return rows
            return self._pool_pass([cache], [job], [context], k)[0]

    def owns(self, job: Job) -> bool:
        """Whether ``job`` runs on one of this member's slots."""
        return isinstance(job.cache, StaticCache) and job.cache.runner is self

    @torch.inference_mode()
    def run_batch(self, jobs: Sequence[Job]) -> list[torch.Tensor] | None:
        """Several requests' jobs in one pass over the first rows of the pool; None when they cannot
        (a row not on one of this member's slots, a job longer than a bucket, a slot too full)."""
        caches = [job.cache for job in jobs]
        if not all(self.owns(job) for job in jobs) or len({id(c) for c in caches}) < len(caches):
            return None
        with self._lock:
            contexts = [int(c.get_seq_length()) for c in caches]
            k = bucket_for(max(len(job.ids) for job in jobs), self.buckets)
            if k is None or not all(c.in_slot() for c in caches) or any(context + k > self.room for context in contexts):
                return None
            self.counts["batched"] += 1
            return self._pool_pass(caches, jobs, contexts, k)

    def _pool_pass(self, caches: Sequence[StaticCache], jobs: Sequence[Job], contexts: Sequence[int],
                   k: int) -> list[torch.Tensor]:
        """The jobs (``k`` tokens or fewer each) in one pass over the pool's first rows: each job's logits rows.

        One request's pass is this pass with one row: its graphs are the member's, shared by
        every slot (a lone request decodes on slot 0, a pass of one row), instead of a set per slot.
        """
        pool = self.pool
        assert pool is not None
        r = bucket_for(max(c.slot.index for c in caches) + 1, self.rows)
        assert r is not None  # a slot index is below the pool's rows
        span = self.span_for(max(contexts) + k)
        bucket = pool.buckets.get((r, k, span)) or pool.buckets.setdefault((r, k, span), self._bucket(r, k, span))
        placed = [(c.slot.index, job, context) for c, job, context in zip(caches, jobs, contexts)]
        fill(bucket.inputs, host_inputs(placed, r, k, self.room))
        place_device_ids(bucket.inputs, [(row, job) for row, job, _ in placed], k)
        out, replayed = self._replay(bucket, pool.keys, pool.values)
        self._commit(caches, contexts, [len(job.ids) for job in jobs], replayed)
        return kept_rows(out, [(row, job.keep) for row, job, _ in placed], k)

    def _commit(self, caches: Sequence[StaticCache], contexts: Sequence[int], fed: Sequence[int],
                replayed: bool) -> None:
        """The states' layers now end after what the pass fed them; count the pass."""
        for cache, context, n in zip(caches, contexts, fed):
            cache.advance(context + n)
            if cache.stats is not None:
                cache.stats.static_passes += 1
                cache.stats.graph_replays += int(replayed)
        self.counts["static"] += 1

    def span_for(self, end: int) -> int:
        """How much of the slot a pass that writes up to ``end`` attends over: the smallest span that holds it.

        Why spans: attention over the whole slot would read ``max_cache_len`` states per layer
        on every step (a 135M drafter's KV at 4096 tokens is a third of its weights); spans
        double from :data:`MIN_SPAN`, so a pass reads at most twice the states it needs, for
        a graph per (rows, tokens, span) actually used.
        """
        return next(s for s in self.spans if s >= end)

    def _bucket(self, r: int, k: int, span: int) -> Bucket:
        device = self.shape.device
        rows = torch.arange(r, device=device)[:, None].expand(r, k).contiguous()
        return Bucket(span, torch.zeros(inputs_size(r, k), dtype=torch.long, device=device), rows)

    def _forward(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], span: int, inputs: torch.Tensor,
                 r: int, k: int, rows: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The model's body over ``span`` states of the slot (``rows`` None) or of the pool's first rows, then its
        head: ``[R, k, V]`` logits, or, with ``keep``, ``[len(keep), V]`` of the one row's positions ``keep``.

        Everything it computes comes from the flat ``inputs`` (:func:`split_inputs`), the masks
        included, so a graph of it needs nothing from the host but one copy into ``inputs``."""
        ids, positions, write, context, block = split_inputs(inputs, r, k)
        visible = block != 0
        masks = {kind: additive_mask(slot_allowed(positions, context, visible, span,
                                                  self.window if kind == "sliding_attention" else None),
                                     self.shape.dtype)
                 for kind in dict.fromkeys(self.types)}
        cache = WriteCache(keys, values, write, span, rows)
        mask: Any = next(iter(masks.values())) if len(masks) == 1 else masks  # as verify-in-line hands them
        hidden = self.model.model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                                  position_ids=positions).last_hidden_state
        logits = self.model.lm_head(hidden if keep is None else hidden[0, keep])
        cap = getattr(text_config(self.model), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _replay(self, bucket: Bucket, keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """The bucket's pass (inputs filled): its graph replayed, captured first if it can be, or run as a call."""
        def run() -> torch.Tensor:
            return self._forward(keys, values, bucket.span, bucket.inputs, bucket.rows_n, bucket.tokens, bucket.rows)

        if bucket.graph is None and bucket.failed is None and self.capturing:
            self._capture(bucket, run)
        if bucket.graph is None:
            return run(), False
        bucket.graph.replay()
        self.counts["replays"] += 1
        assert bucket.out is not None
        return bucket.out, True

    def _capture(self, bucket: Bucket, run: Callable[[], torch.Tensor]) -> None:
        """Record ``run`` (the bucket's pass, inputs already filled) as a CUDA graph; on failure say why and stay eager.

        The warm-up runs and the capture see the pass's real inputs, so what they write into
        the slots is what the replay that follows writes again. Every graph of the member
        shares one memory pool (they never run at the same time: the lock).
        """
        try:
            bucket.graph, bucket.out = capture_graph(run, self.shape.device, self._graph_pool)
            self._graph_pool = self._graph_pool or bucket.graph.pool()
            self.counts["captures"] += 1
        except Exception as exc:  # a capture that fails costs this bucket its graph, never the request
            bucket.failed = f"{type(exc).__name__}: {exc}"
            self.reasons[f"bucket {bucket.key}"] = bucket.failed

    def _exact(self, slot: Slot, job: Job, context: int) -> torch.Tensor:
        """A pass at its own length (longer than every bucket: a prefill): static writes, no padding, no graph."""
        device, n = self.shape.device, len(job.ids)
        inputs = to_device(host_inputs([(0, job, context)], 1, n, self.room), device)
        place_device_ids(inputs, [(0, job)], n)
        keep = to_device(job.keep, device)
        return self._forward(slot.keys, slot.values, context + n, inputs, 1, n, keep=keep).float()


#: One capture at a time in the process: CUDA records one capture sequence per stream, and two
#: members capturing at once (two requests' first passes of a new shape) would otherwise both begin.
_CAPTURE_LOCK = threading.Lock()


def capture_graph(run: Callable[[], torch.Tensor], device: torch.device,
                  pool: Any = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``run`` recorded as a CUDA graph on ``device`` and the output buffer its replays fill (in the memory ``pool``,
    another graph's ``pool()``; None: a new pool).

    Captures happen on a member's first pass of a shape, while other requests' threads go on
    with their own CUDA work (fusion, sampling, reading results, other members' passes), not at
    start-up before anything runs as in vLLM. Hence, beyond torch's recipe (eager warm-up runs
    on a side stream, so lazy initialisation is not recorded):

    * ``capture_error_mode="thread_local"``: under torch's default ("global") a copy, an
      allocation or a synchronisation issued by *any* thread during the capture invalidates it
      and fails in that thread, i.e. an unrelated request would fail (vLLM moved every capture
      path to thread_local for the same reason). The capture follows the stream, so other
      threads' kernels on their own streams are neither recorded nor blocked;
    * the capture runs under ``torch.cuda.device(device)`` on a stream of that device: torch's
      shared capture stream belongs to whichever device was current when first used, and a
      member on ``cuda:1`` captured on a stream of ``cuda:0`` records nothing (its kernels go to
      its own device's stream), so its replays would return a stale buffer;
    * one capture at a time (:data:`_CAPTURE_LOCK`).
    """
    with _CAPTURE_LOCK, torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            out = run()
    return graph, out


def _release(slot: Slot) -> None:
    slot.busy = False


def route(job: Job) -> Job:
    """``job``, run by its slot's :class:`StaticPasses` when its cache is on one (its eager call stays the fallback).

    Every pass of a :class:`~ensemble_core.decoding.members.DecodeState` is built as a
    :class:`~ensemble_core.decoding.forward.Job` and goes through here, alone or batched
    (a batched group of static rows: :meth:`StaticPasses.run_batch`). The runner is a bound
    method, not a closure over the job: a cycle would keep the state's slot lent until the
    garbage collector ran.
    """
    if isinstance(job.cache, StaticCache):
        job.runner = job.cache.runner.run
    return job
