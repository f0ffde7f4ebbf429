"""Weight quantization of a member on a CPU: dynamic int8 for the body's linear layers.

Why this exists. Decoding these members on a CPU is bound by reading float32 weights
(a Qwen2.5-0.5B step reads ~2.5 GB) and a verify pass over ~9 positions by the body's
matrix products. Dynamic int8 (PyTorch's fbgemm / oneDNN kernels: int8 weights with one
scale per output channel, activations quantized per call) cuts both: measured on this
2-core AVX2 CPU, one thread, a Qwen2.5-Coder-0.5B step 212-231 -> 137 ms, its 9-token
verify pass 663-693 -> 313 ms; SmolLM2-135M 89-117 -> 66-84 ms and 175-269 -> 93-131 ms.

What it costs. Greedy outputs change (the first differing token came at position 0-1 in
the measured prompts): for Qwen2.5-Coder the text stayed as good (arith, 20 questions, 2
shots: 100 % correct either way, 1.89x less time per output character), for SmolLM2-135M
it did not (a GSM8K chain of thought turned into "A: 16." repeated). Hence opt-in and per
member (``MemberSpec(quantize="int8")``): quantize the big member, keep a small drafter
in float32. The output head stays float32 (it decides the token; the oneDNN product of
:mod:`ensemble_core.models.products` keeps it cheap), and so do embeddings and norms.

The kernels come from ``torch.ao.quantization.quantize_dynamic``, which PyTorch has
deprecated in favour of torchao (pytorch/ao#2259) but still ships; torchao's CPU path
needs ``torch.compile`` to be fast. When the torch.ao path goes, this module is the one
place to change. Float32 members on a CPU only: other dtypes and accelerators raise.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ensemble_core.errors import InvalidOptionError

#: Values of ``MemberSpec.quantize`` (None: no quantization).
SCHEMES = ("int8",)


def check_scheme(scheme: Any, dtype: torch.dtype, device: str | None, device_map: Any) -> None:
    """Fail at spec time for a scheme this module cannot apply (typed error naming the fix)."""
    if scheme is None:
        return
    if scheme not in SCHEMES:
        raise InvalidOptionError("quantize", scheme, "None or one of " + ", ".join(repr(s) for s in SCHEMES))
    on_cpu = device_map is None and (device is None or torch.device(device).type == "cpu")
    if not on_cpu:
        raise InvalidOptionError("quantize", scheme, "None for a member off the CPU (int8 here uses CPU kernels); "
                                 "drop quantize or place the member with device='cpu'")
    if dtype != torch.float32:
        raise InvalidOptionError("quantize", scheme, f"None with dtype {dtype} (int8 is made from float32 weights); "
                                 "pass dtype='float32' or 'auto'")


def quantize_int8(model: Any) -> int:
    """Replace ``model``'s ``Linear`` layers, except the output head, by dynamic-int8 ones in place.

    Returns the number of layers replaced. Per-output-channel weight scales (per-tensor
    ones lose more of these small models' quality).
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    names = {name: per_channel_dynamic_qconfig for name, module in model.named_modules()
             if type(module) is torch.nn.Linear and module is not head}
    if names:
        with warnings.catch_warnings():  # torch.ao's deprecation notice: see the module docstring
            warnings.simplefilter("ignore", category=UserWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)
    return len(names)


def quantize(model: Any, scheme: str | None) -> int:
    """Apply ``scheme`` (:data:`SCHEMES`, or None for nothing) to a loaded model; layers changed."""
    if scheme is None:
        return 0
    if scheme == "int8":
        return quantize_int8(model)
    raise InvalidOptionError("quantize", scheme, "None or one of " + ", ".join(repr(s) for s in SCHEMES))
