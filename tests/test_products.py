"""A member's float32 products on a CPU (:mod:`ensemble_core.products`): same values, same parameters."""

from __future__ import annotations

import pytest
import torch

from ensemble_core.products import CpuLinear, onednn_available, project, use_cpu_products
from ensemble_core.testing import random_ids, tiny_member


def test_onednn_is_used_on_this_machine() -> None:
    """The speed of every member on this project's CPUs depends on it: a missing op must show."""
    from torch.profiler import ProfilerActivity, profile

    assert onednn_available()
    model = torch.nn.Sequential(torch.nn.Linear(64, 300))
    use_cpu_products(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        model(torch.randn(5, 64))
    ops = {e.key for e in prof.key_averages()}
    assert "mkldnn::_linear_pointwise" in ops and "aten::addmm" not in ops, ops


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 200])
def test_project_equals_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3000, 64, generator=gen)
    bias = torch.randn(3000, generator=gen)
    x = torch.randn(1, rows, 64, generator=gen)  # the [batch, positions, hidden] a layer is given
    for b in (None, bias):
        got = project(x, weight, b)
        assert got.shape == (1, rows, 3000) and got.is_contiguous()
        assert torch.allclose(got, torch.nn.functional.linear(x, weight, b), atol=1e-4)
    strided = torch.randn(rows, 2, 64, generator=gen)[:, 0]  # a gathered row view (batching's head input)
    assert torch.allclose(project(strided, weight), torch.nn.functional.linear(strided, weight), atol=1e-4)


def test_project_leaves_other_dtypes_and_odd_weights_to_linear() -> None:
    weight = torch.randn(300, 16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(project(x, weight.bfloat16()), torch.nn.functional.linear(x, weight.bfloat16()))
    transposed = torch.randn(16, 300).t()  # not contiguous: linear, as before
    one = torch.randn(2, 16)
    assert torch.equal(project(one, transposed), torch.nn.functional.linear(one, transposed))


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_members_get_cpu_products_and_keep_their_logits(alias: str) -> None:
    member = tiny_member(alias, seed=1)
    linears = [m for m in member.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is CpuLinear for m in linears)  # body and head
    head = member.model.get_output_embeddings()
    if member.model.config.tie_word_embeddings:  # still the input embedding's parameter: nothing copied
        assert head.weight is member.model.get_input_embeddings().weight
    ids = torch.tensor([random_ids(12, 3)])
    with torch.inference_mode():
        fast = member.model(input_ids=ids).logits
        for m in linears:
            m.__class__ = torch.nn.Linear
        try:
            plain = member.model(input_ids=ids).logits
        finally:
            for m in linears:
                m.__class__ = CpuLinear
    assert torch.allclose(fast, plain, atol=1e-4), float((fast - plain).abs().max())
    assert use_cpu_products(member.model) == 0  # idempotent: nothing plain is left


def test_subclasses_and_non_linears_are_left_alone() -> None:
    class Custom(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), Custom(3, 4), torch.nn.ReLU())
    assert use_cpu_products(model) == 1
    assert [type(m) for m in model] == [CpuLinear, Custom, torch.nn.ReLU]
