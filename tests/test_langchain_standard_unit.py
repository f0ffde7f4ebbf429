"""langchain-tests unit suite for ChatEnsemble, on tiny random-weight members (no real weights needed).

The unit suite checks construction, standard parameters, serialisation hooks and the
capability declarations (tool calling, tool choice and structured output included: every
tool and schema type of the suite binds, and every ``with_structured_output`` method and
``strict`` value builds); it needs no sensible text, so it runs on tiny members with the
real tokenizers and stays in the fast part of the suite.
"""

from __future__ import annotations

import functools
from typing import Any

from langchain_ensemble import ChatEnsemble
from langchain_tests.unit_tests import ChatModelUnitTests

from ensemble_core import Member
from ensemble_core.testing import tiny_member


@functools.cache
def tiny_pair() -> tuple[Member, Member]:
    return tiny_member("gemma3-270m", seed=0, name="tiny-gemma"), tiny_member("smollm2-135m-instruct", seed=0,
                                                                              name="tiny-smollm2")


class TestChatEnsembleUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatEnsemble]:
        return ChatEnsemble

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"members": list(tiny_pair()), "method": "safe"}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True
