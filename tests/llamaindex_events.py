"""LlamaIndex's instrumentation, listened to, for the LlamaIndex tests (one recorder for all of them)."""

from __future__ import annotations

from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent


class Events:
    """Every event LlamaIndex dispatches while the ``with`` block runs (on the root dispatcher, where every
    llama_index event propagates): what each chat call was asked, which events fired."""

    def __init__(self) -> None:
        seen: list[Any] = []

        class Handler(BaseEventHandler):
            def handle(self, event, **kwargs) -> None:  # noqa: ANN001 - LlamaIndex's signature
                seen.append(event)

        self.seen, self.handler, self.dispatcher = seen, Handler(), get_dispatcher()

    def __enter__(self) -> Events:
        self.dispatcher.add_event_handler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispatcher.event_handlers.remove(self.handler)

    def of(self, *kinds: type) -> list[Any]:
        """The events of these types, in order."""
        return [e for e in self.seen if isinstance(e, kinds)]

    def chat_kwargs(self) -> list[dict]:
        """What each chat call was asked (its ``additional_kwargs``)."""
        return [e.additional_kwargs for e in self.of(LLMChatStartEvent)]

    def kinds(self) -> set[str]:
        return {type(e).__name__ for e in self.seen}
