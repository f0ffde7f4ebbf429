"""A member's float32 products on a CPU (:mod:`ensemble_core.models.products`): same values, same parameters."""

from __future__ import annotations

import pytest
import torch

from ensemble_core import Member
from ensemble_core.models.products import (
    PREPACK_MEMORY_SHARE,
    CpuLinear,
    FusedProjections,
    available_memory,
    is_prepacked,
    onednn_available,
    packable_bytes,
    prepack,
    prepack_available,
    project,
    should_prepack,
    use_cpu_products,
)
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


# ----------------------------------------------------------------------------- prepacked weights
def test_prepacked_products_serve_several_rows_with_the_dense_values() -> None:
    """2+ rows read the prepacked copy (bit for bit the dense product), one row the dense weight."""
    assert prepack_available()
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(700, 96, generator=gen), torch.randn(700, generator=gen)
    packed = prepack(weight)
    assert packed is not None and packed.is_mkldnn
    zeros = torch.zeros_like(weight)  # a different dense weight shows which copy a product read
    for rows in (2, 5, 64):
        x = torch.randn(1, rows, 96, generator=gen)
        assert torch.equal(project(x, weight, bias, packed), project(x, weight, bias))
        assert torch.equal(project(x, zeros, bias, packed), project(x, weight, bias))  # the packed copy
    one = torch.randn(1, 1, 96, generator=gen)
    assert torch.equal(project(one, zeros, bias, packed), project(one, zeros, bias))  # one row: the dense weight


def test_prepack_leaves_other_dtypes_and_devices_alone() -> None:
    assert prepack(torch.randn(8, 4).bfloat16()) is None
    assert prepack(torch.randn(4, 8).t()) is None  # not contiguous
    layer = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
    use_cpu_products(layer)
    assert type(layer) is CpuLinear and layer.packed() is None


def test_a_weight_changed_in_place_drops_its_packed_copy() -> None:
    layer = torch.nn.Linear(16, 40)
    use_cpu_products(layer)
    assert layer.packed() is not None
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer.weight.mul_(2)  # fine-tuning, a weight loaded afterwards: the copy is stale
        assert layer.packed() is None
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert use_cpu_products(layer) == 0 and layer.packed() is not None  # packed again on request


def test_use_cpu_products_without_prepacking_keeps_one_copy() -> None:
    layer = torch.nn.Linear(16, 40)
    use_cpu_products(layer, prepacked=False)
    assert type(layer) is CpuLinear and layer.packed() is None
    assert "_packed" not in layer.state_dict() and list(layer.state_dict()) == ["weight", "bias"]


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_members_prepacked_give_the_same_logits_bit_for_bit(alias: str) -> None:
    """Prefill, a verify window and a step: prepacking changes the speed, not one value."""
    member = tiny_member(alias, seed=2)
    linears = [m for m in member.model.modules() if type(m) is CpuLinear and "_group" not in m.__dict__]
    groups = _groups(member.model)
    assert linears and groups  # o_proj, down_proj, the head; stacked q/k/v and gate/up
    assert all(m.packed() is not None for m in linears) and all(g.packed is not None for g in groups)

    def run() -> list[torch.Tensor]:
        # no prefix cache: each run prefills the whole prompt (the second would reuse the first's states)
        state = Member(member.model, member.tokenizer, prefix_cache=0).start_from_ids(random_ids(30, 4))
        return [state.score(), state.score(random_ids(6, 5)), state.score(random_ids(1, 6))]

    packed = run()
    saved = [m.__dict__.pop("_packed") for m in linears], [g.packed for g in groups]
    for g in groups:
        g.packed = None
    try:
        dense = run()
    finally:
        for m, entry in zip(linears, saved[0]):
            m.__dict__["_packed"] = entry
        for g, copy in zip(groups, saved[1]):
            g.packed = copy
    assert all(torch.equal(a, b) for a, b in zip(packed, dense))


def test_member_spec_prepack_option() -> None:
    from ensemble_core.cli import build_parser
    from ensemble_core.errors import InvalidOptionError
    from ensemble_core.flags import member_options
    from ensemble_core.models.loading import MemberSpec, per_member_options

    assert MemberSpec("smollm2-135m-instruct").prepack is None  # decided at load, by the memory available
    with pytest.raises(InvalidOptionError, match="prepack"):
        MemberSpec("smollm2-135m-instruct", prepack="no")
    assert per_member_options(2, "auto", prepack=False) == [{"dtype": "auto", "prepack": False}] * 2
    assert per_member_options(1, "auto") == [{"dtype": "auto"}]
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--prepack", "off"])
    assert member_options(args, 1) == [{"dtype": "auto", "prepack": False}]
    assert build_parser().parse_args(["bench"]).prepack == "auto"


def test_prepack_when_the_copy_fits_in_memory() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 10, dtype=torch.bfloat16))
    assert packable_bytes(model) == 100 * 50 * 4  # float32 CPU weights only
    assert should_prepack(model, None)  # memory unknown: pack
    assert should_prepack(model, int(20_000 / PREPACK_MEMORY_SHARE))
    assert not should_prepack(model, int(20_000 / PREPACK_MEMORY_SHARE) - 1)
    available = available_memory()
    assert available is None or available > 0
    assert not is_prepacked(model)
    use_cpu_products(model)
    assert is_prepacked(model)


# ----------------------------------------------------------------------------- fused sibling projections
def _groups(model: torch.nn.Module) -> list[FusedProjections]:
    return list({id(g): g for g in (m.__dict__["_group"][0] for m in model.modules() if "_group" in m.__dict__)}.values())


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_fused_projections_give_every_layer_its_own_product_bit_for_bit(alias: str) -> None:
    member = tiny_member(alias, seed=3, layers=3)
    groups = _groups(member.model)
    assert len(groups) == 2 * 3 and all(g.stacking and g.packed is not None for g in groups)  # q/k/v and gate/up
    for group in groups:  # the layers' weights are views of the stacked one: nothing stored twice
        for layer in group.layers:
            assert layer.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()

    def run() -> list[torch.Tensor]:
        # no prefix cache: each run prefills the whole prompt (the second would reuse the first's states)
        state = Member(member.model, member.tokenizer, prefix_cache=0).start_from_ids(random_ids(40, 7))
        return [state.score(), state.score(random_ids(5, 8)), state.score(random_ids(1, 9))]

    stacked = run()
    for group in groups:
        group.stacking = False
    try:
        separate = run()
    finally:
        for group in groups:
            group.stacking = True
    assert all(torch.equal(a, b) for a, b in zip(stacked, separate))


class _Siblings(torch.nn.Module):
    """q/k/v projections; ``cross`` gives k and v another input, as a cross-attention block does."""

    def __init__(self, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(24, n) for n in (32, 8, 8))

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        kv = other if self.cross else x
        return torch.cat([self.q_proj(x), self.k_proj(kv), self.v_proj(kv)], dim=-1)


def _reference(model: _Siblings, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    kv = other if model.cross else x
    lin = torch.nn.functional.linear
    return torch.cat([lin(x, model.q_proj.weight, model.q_proj.bias), lin(kv, model.k_proj.weight, model.k_proj.bias),
                      lin(kv, model.v_proj.weight, model.v_proj.bias)], dim=-1)


def test_siblings_that_read_other_inputs_stop_stacking_and_stay_right() -> None:
    model = _Siblings(cross=True)
    use_cpu_products(model)
    (group,) = _groups(model)
    x, other = torch.randn(3, 24), torch.randn(3, 24)
    with torch.no_grad():
        assert torch.allclose(model(x, other), _reference(model, x, other), atol=1e-5)
        assert not group.stacking  # learnt from the first pass
        assert torch.allclose(model(x, other), _reference(model, x, other), atol=1e-5)


def test_stacked_weights_changed_or_replaced_after_packing() -> None:
    model = _Siblings()
    use_cpu_products(model)
    (group,) = _groups(model)
    x = torch.randn(4, 24)
    with torch.no_grad():
        assert torch.allclose(model(x, x), _reference(model, x, x), atol=1e-5) and group.stacking
        model.k_proj.weight.mul_(3)  # in place: the stacked weight sees it, its packed copy is stale
        assert torch.allclose(model(x, x), _reference(model, x, x), atol=1e-5)
        assert group.stacking and group.packed is None
        model.v_proj.weight = torch.nn.Parameter(torch.randn(8, 24))  # replaced: no longer a view
        assert torch.allclose(model(x, x), _reference(model, x, x), atol=1e-5)
        assert not group.stacking
    assert set(model.state_dict()) == {f"{n}.{p}" for n in ("q_proj", "k_proj", "v_proj") for p in ("weight", "bias")}


def test_a_prepacked_model_can_be_copied_and_saved() -> None:
    """oneDNN's packed tensors cannot be copied: a copy drops them (and the stacking) and computes the same values."""
    import copy
    import io

    member = tiny_member("qwen2.5-coder-0.5b-instruct", seed=4)
    ids = torch.tensor([random_ids(12, 3)])
    with torch.inference_mode():
        want = member.model(input_ids=ids).logits
    twin = copy.deepcopy(member.model)
    assert not is_prepacked(twin) and not _groups(twin)
    buffer = io.BytesIO()
    torch.save(member.model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.inference_mode():
        assert torch.allclose(twin(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)
    use_cpu_products(twin)  # packs and stacks the copy again
    assert is_prepacked(twin) and len(_groups(twin)) == len(_groups(member.model))
    with torch.inference_mode():
        assert torch.equal(twin(input_ids=ids).logits, want)
    assert is_prepacked(member.model) and _groups(member.model)  # the original is untouched
