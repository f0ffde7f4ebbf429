"""langchain-tests integration suite for ChatEnsemble on the bundled real pair.

Every group whose capability flag is on runs unmodified. Off: tool calling, structured
output, JSON mode, multimodal inputs (the members are text-only and the adapter has no
tool protocol yet). ``max_tokens`` is small so that the integration suite stays fast on CPU.
The unit suite runs on tiny members in ``test_langchain_standard_unit.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_ensemble import ChatEnsemble
from langchain_tests.integration_tests import ChatModelIntegrationTests

pytestmark = pytest.mark.real

PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
METHOD = "safe"


class TestChatEnsembleIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatEnsemble]:
        return ChatEnsemble

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"members": PAIR, "method": METHOD, "max_tokens": 16}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def model_override_value(self) -> str:
        # A per-call `model="a+b"` selects other members (same method and config).
        return "+".join(reversed(PAIR))
