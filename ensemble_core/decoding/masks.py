"""Attention masks and layer layouts: what a query may see, for every pass that is not plain causal.

Two kinds of passes feed a model something other than "new ids after the whole cache":
verify-in-line packs several candidates behind one cached context
(:mod:`~ensemble_core.decoding.verify_inline`), and a batched pass lays rows of different
requests side by side (:mod:`~ensemble_core.decoding.forward`). Both hand the model explicit
position ids and a custom 4-D additive mask, and both must reproduce what the model's own
mask would do on each layer type: full causal attention, or causal attention within a
sliding window (Gemma-3). transformers returns a custom 4-D mask unchanged for every layer
type, so the window is applied here, once, for both. The helpers take states and jobs by
duck type (``.cache``, ``.member``; ``.ids``, ``.layout()``), so this module sits
below both users.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ensemble_core.errors import UnsupportedModelError
from ensemble_core.transfer import HOST, to_device

#: Attention implementations that add a custom 4-D float mask to the scores (FlashAttention
#: ignores it): what verify-in-line, batched and static passes need.
MASK_HONOURING_ATTENTION = ("sdpa", "eager")


def text_config(model: Any) -> Any:
    """The config of a model's text part (multimodal configs nest it)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_types(model: Any) -> list[str]:
    """Attention type of every decoder layer (``full_attention`` when the config says nothing)."""
    cfg = text_config(model)
    types = getattr(cfg, "layer_types", None)
    if not types:
        n = int(getattr(cfg, "num_hidden_layers", 1))
        kind = "sliding_attention" if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False) \
            else "full_attention"
        types = [kind] * n
    return list(types)


def sliding_window(model: Any) -> int | None:
    """The model's sliding-window size (None: no sliding layers)."""
    window = getattr(text_config(model), "sliding_window", None)
    return int(window) if window else None


def window_of(state: Any, layer_idx: int) -> int:
    """The window of a state's sliding layer ``layer_idx`` (its cache layer's, else the config's)."""
    layer = state.cache.layers[layer_idx] if layer_idx < len(state.cache.layers) else None
    window = getattr(layer, "sliding_window", None) or getattr(text_config(state.member.model), "sliding_window", None)
    if not window:
        raise UnsupportedModelError(f"Member {state.member.name!r} has sliding layers but no sliding_window size.")
    return int(window)


def packed_layout(lengths: Sequence[int], context: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and new-token visibility (``own[i, j]``) of candidates packed after ``context`` ids.

    Positions restart at the context length for every candidate; a token sees the earlier
    tokens of its own candidate only. Shared by :func:`packed_masks` and the batcher.
    """
    n = int(sum(lengths))
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(list(lengths), device=device))
    offsets = torch.cat([torch.arange(k, device=device) for k in lengths])
    idx = torch.arange(n, device=device)
    own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return context + offsets, own


def packed_masks(state: Any, lengths: Sequence[int]) -> tuple[Any, torch.Tensor]:
    """Attention mask(s) and position ids for candidates of ``lengths`` packed after the cached context.

    Returns ``(mask, position_ids)``: ``mask`` is one ``[1, 1, N, kv]`` additive float
    tensor, or a ``{layer_type: mask}`` mapping for models that mix layer types.
    """
    model, device = state.member.model, state.member.device
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    n = int(sum(lengths))
    context = state.cache.get_seq_length()
    # laid out on the host and handed over without a wait: built on a GPU, the lengths' copy and
    # repeat_interleave's output size each synchronised the stream once per packed pass (#38)
    q_pos, own = (to_device(t, device) for t in packed_layout(lengths, context, HOST))
    types = layer_types(model)
    masks: dict[str, torch.Tensor] = {}
    for kind in dict.fromkeys(types):
        layer_idx = types.index(kind)
        kv_length, kv_offset = state.cache.get_mask_sizes(n, layer_idx)
        visible = kv_length - n  # cached states this layer type attends to
        k_pos = kv_offset + torch.arange(visible, device=device)
        ctx_ok = torch.ones(n, visible, dtype=torch.bool, device=device)
        new_ok = own
        if kind == "sliding_attention":
            window = window_of(state, layer_idx)
            ctx_ok = (q_pos[:, None] - k_pos[None, :]) < window
            new_ok = own & ((q_pos[:, None] - q_pos[None, :]) < window)
        elif visible != context:
            raise UnsupportedModelError(f"Layer type {kind!r} exposes {visible} of {context} cached states.")
        allowed = torch.cat([ctx_ok, new_ok], dim=1)
        masks[kind] = additive_mask(allowed[None], dtype)
    mask_arg: Any = masks[types[0]] if len(masks) == 1 else masks
    return mask_arg, q_pos[None]


def allow_row(allowed: torch.Tensor, job: Any, first_pos: int, ctx_col: int, visible: int, new_col: int,
              window: int | None) -> None:
    """Fill one row's ``[N, K]`` visibility: ``visible`` cached keys (positions from ``first_pos``) at
    columns ``ctx_col ..``, the job's new tokens at ``new_col ..`` (its ``block``), causal by position
    and within ``window`` (sliding layers); padding queries see themselves (no all-masked row)."""
    device = allowed.device
    n, width_new = len(job.ids), allowed.shape[0]
    positions, block = job.layout()
    q = positions.to(device)
    k_pos = first_pos + torch.arange(visible, device=device)
    ctx_ok = k_pos[None, :] <= q[:, None]
    new_ok = block.to(device)
    if window is not None:
        ctx_ok = ctx_ok & ((q[:, None] - k_pos[None, :]) < window)
        new_ok = new_ok & ((q[:, None] - q[None, :]) < window)
    allowed[:n, ctx_col:ctx_col + visible] = ctx_ok
    allowed[:n, new_col:new_col + n] = new_ok
    pads = torch.arange(n, width_new, device=device)
    allowed[pads, new_col + pads] = True


def slot_allowed(positions: torch.Tensor, context: torch.Tensor, block: torch.Tensor, span: int,
                 window: int | None) -> torch.Tensor:
    """``[R, k, span]`` visibility of a pass over KV slots, from its inputs alone.

    Row ``r``'s cached states fill columns ``[0, context[r])`` at positions equal to their
    column; its ``k`` new tokens (``positions[r]``) are written at ``context[r] ..`` and see each
    other as ``block[r]`` says (``[k, k]``, padding queries included: they see their own column).
    A cached state is visible to a query at or after its position, and within ``window``
    positions on sliding layers. Pure tensor ops on the inputs' device, no host read and no
    size taken from the values: a CUDA graph records it with the pass, so a replay builds
    its masks itself from the few numbers the host copied in
    (:mod:`~ensemble_core.decoding.static`).
    """
    r, k = positions.shape
    cols = torch.arange(span, device=positions.device)
    rel = cols[None, None, :] - context[:, None, None]  # [R, 1, S]: the new token a column holds, if any
    at = rel.clamp(0, k - 1)
    new = (rel >= 0) & (rel < k)
    q = positions[:, :, None]
    allowed = ((rel < 0) & (cols <= q)) | (new & block.gather(2, at.expand(r, k, span)))
    if window is not None:
        key_pos = torch.where(new[:, 0], positions.gather(1, at[:, 0]), cols)  # [R, S]
        allowed = allowed & ((q - key_pos[:, None, :]) < window)
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, N, K]`` booleans as the ``[B, 1, N, K]`` additive mask attention takes."""
    fill = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, fill)[:, None]
