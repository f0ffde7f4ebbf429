"""The few-row vocabulary projection (:mod:`ensemble_core.head`): same values, same parameters."""

from __future__ import annotations

import pytest
import torch

from ensemble_core.head import FEW_ROWS, FewRowHead, project, use_few_row_head
from ensemble_core.testing import random_ids, tiny_member


@pytest.mark.parametrize("rows", [1, 2, 5, FEW_ROWS, FEW_ROWS + 1, 200])
def test_project_equals_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(3000, 64, generator=gen)
    bias = torch.randn(3000, generator=gen)
    x = torch.randn(1, rows, 64, generator=gen)  # the [batch, positions, hidden] a head is given
    for b in (None, bias):
        got = project(x, weight, b)
        assert got.shape == (1, rows, 3000) and got.is_contiguous()
        assert torch.allclose(got, torch.nn.functional.linear(x, weight, b), atol=1e-4)


def test_project_leaves_other_dtypes_and_one_row_to_linear() -> None:
    weight = torch.randn(300, 16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(project(x, weight.bfloat16()), torch.nn.functional.linear(x, weight.bfloat16()))
    one = torch.randn(1, 16)
    assert torch.equal(project(one, weight), torch.nn.functional.linear(one, weight))


@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_members_get_the_few_row_head_and_keep_their_logits(alias: str) -> None:
    member = tiny_member(alias, seed=1)
    head = member.model.get_output_embeddings()
    assert type(head) is FewRowHead
    if member.model.config.tie_word_embeddings:  # still the input embedding's parameter: nothing copied
        assert head.weight is member.model.get_input_embeddings().weight
    ids = torch.tensor([random_ids(12, 3)])
    with torch.inference_mode():
        fast = member.model(input_ids=ids).logits  # 12 rows: the rewritten product
        head.__class__ = torch.nn.Linear
        try:
            plain = member.model(input_ids=ids).logits
        finally:
            head.__class__ = FewRowHead
    assert torch.allclose(fast, plain, atol=1e-4), float((fast - plain).abs().max())
    assert use_few_row_head(member.model) is True  # idempotent


def test_a_head_that_is_not_a_plain_linear_is_left_alone() -> None:
    class Custom(torch.nn.Linear):
        pass

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = Custom(4, 8)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.lm_head

    model = Model()
    assert use_few_row_head(model) is False and type(model.lm_head) is Custom
    assert use_few_row_head(torch.nn.Linear(2, 2)) is False  # no output embeddings at all
