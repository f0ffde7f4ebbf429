"""``EnsembleLLM``: a LlamaIndex LLM whose every answer is produced by an ensemble.

The class is thin on purpose, like ``HuggingFaceLLM``: metadata, message conversion and
the sync / async / streaming plumbing. All generation logic (SAFE, SpecEM, the
baselines, stop strings, cancellation, token counting) lives in
:class:`ensemble_core.Ensemble`, which the LangChain adapter wraps too.

Threading (see :mod:`ensemble_core.runtime`): the core's generation is a blocking iterator (one method
round per step). The async methods run it in a worker thread, so the event loop keeps
serving other tasks; cancelling the awaiting task sets the core stream's cancel event and
the worker stops after the round it is in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any, Dict, List

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_serializer
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from ensemble_core import DEFAULT_MEMBERS, ConfigurationError, Ensemble, GenerationResult, InvalidOptionError, Member
from ensemble_core.chat import Prompt
from ensemble_core.runtime import Run, shared_ensemble

from .messages import extra_kwargs, raw_payload, to_core_messages

#: Options that are EnsembleLLM fields; method_config must not set them a second time.
LLM_OPTIONS = ("max_new_tokens", "stop", "temperature", "do_sample")
#: Template tokens every prompt may add on top of what LlamaIndex counts (SmolLM2's
#: template adds 30 with its default system prompt).
TEMPLATE_MARGIN = 64


def default_context_margin(window: int) -> int:
    """Tokens kept free below the smallest member window.

    LlamaIndex fits prompts with its own counting tokenizer (tiktoken cl100k unless
    ``Settings.tokenizer`` is set), not with the members' tokenizers. Measured on English
    prose, SmolLM2 needs 1.09x and Gemma-3 1.07x as many tokens as cl100k; an eighth of
    the window covers up to 1.14x, plus room for the chat template's own tokens.
    """
    return window // 8 + TEMPLATE_MARGIN


class EnsembleLLM(LLM):
    """Several local models answering as one LlamaIndex LLM.

    ``Settings.llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma3-270m"], method="safe")``
    makes every query engine, chat engine and agent use the ensemble. Each member sees the
    conversation through its own chat template; responses carry token usage in
    ``raw["usage"]`` (``TokenCountingHandler`` reads it) and the method's statistics in
    ``additional_kwargs["ensemble_stats"]``.
    """

    members: List[Any] = Field(
        default_factory=lambda: list(DEFAULT_MEMBERS),
        description="Aliases, local paths, Hugging Face ids, MemberSpec or Member objects.",
    )
    method: str = Field(default="safe", description="Ensemble method: safe, specem, single, every-token, ...")
    method_config: Dict[str, Any] = Field(
        default_factory=dict, description="Method options (lookahead, segment_length, top_p, seed, ...)."
    )
    member_options: Dict[str, Any] = Field(
        default_factory=dict, description="Loading options for members given by name (dtype, device, device_map)."
    )
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens generated per call (primary member's tokens).")
    temperature: float = Field(default=0.0, ge=0.0, description="0 decodes greedily; above 0 samples at this temperature.")
    stop: List[str] = Field(default_factory=list, description="Strings that end the response (not included in it).")
    context_margin: int | None = Field(
        default=None, ge=0, description="Tokens kept free below the smallest member window (default: window/8 + 64)."
    )

    _ensemble: Ensemble = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        reserved = sorted(set(self.method_config) & set(LLM_OPTIONS))
        if reserved:
            raise ConfigurationError(
                f"method_config sets {', '.join(reserved)}: pass these as EnsembleLLM fields "
                "(max_new_tokens=, stop=, temperature=) instead, so that there is one place for them."
            )
        self._ensemble = shared_ensemble(self.members, self.method, self.method_config, self.member_options)

    @classmethod
    def class_name(cls) -> str:
        return "EnsembleLLM"

    @field_serializer("members")
    def _serialize_members(self, members: List[Any]) -> List[str]:
        return [m.name if isinstance(m, Member) else str(m) for m in members]

    # ------------------------------------------------------------------ properties
    @property
    def ensemble(self) -> Ensemble:
        """The core ensemble doing the work (shared by identical configurations)."""
        return self._ensemble

    @property
    def metadata(self) -> LLMMetadata:
        window = self._ensemble.context_window
        margin = self.context_margin if self.context_margin is not None else default_context_margin(window)
        return LLMMetadata(
            context_window=max(window - margin, 1),
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self._ensemble.name,
            system_role=MessageRole.SYSTEM,
        )

    # ------------------------------------------------------------------ options
    def _overrides(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Per-call generation options: the fields, then the call's keyword arguments.

        ``max_tokens`` is accepted as LlamaIndex's usual name for ``max_new_tokens``; any
        other name must be a field of the method's config, so that a typo raises instead
        of being ignored.
        """
        opts = dict(kwargs)
        if "max_tokens" in opts and "max_new_tokens" in opts:
            raise ConfigurationError("Pass max_new_tokens or max_tokens, not both.")
        max_new = opts.pop("max_new_tokens", opts.pop("max_tokens", self.max_new_tokens))
        temperature = opts.pop("temperature", self.temperature)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise InvalidOptionError("temperature", temperature, "a number >= 0 (0 decodes greedily)")
        extra_stop = opts.pop("stop", None) or []
        if isinstance(extra_stop, str):
            extra_stop = [extra_stop]
        stop = tuple(dict.fromkeys([*self.stop, *extra_stop]))
        known = {f.name for f in dataclasses.fields(self._ensemble.config)} - set(LLM_OPTIONS)
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigurationError(
                f"Unknown generation option(s) {', '.join(unknown)} for method {self.method!r}; "
                f"known: max_new_tokens (or max_tokens), temperature, stop, {', '.join(sorted(known))}."
            )
        out: Dict[str, Any] = {"max_new_tokens": max_new, "stop": stop, "do_sample": temperature > 0, **opts}
        if temperature > 0:
            out["temperature"] = float(temperature)
        return out

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _run(self, prompt: Prompt, kwargs: Dict[str, Any]) -> Run:
        return Run(self._ensemble, prompt, self._overrides(kwargs))

    # ------------------------------------------------------------------ responses
    def _completion(self, result: GenerationResult, text: str | None = None, delta: str | None = None) -> CompletionResponse:
        return CompletionResponse(text=result.text if text is None else text, delta=delta,
                                  raw=raw_payload(result, self._ensemble.name), additional_kwargs=extra_kwargs(result))

    def _chat_response(self, result: GenerationResult, text: str | None = None, delta: str | None = None) -> ChatResponse:
        content = result.text if text is None else text
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content), delta=delta,
                            raw=raw_payload(result, self._ensemble.name), additional_kwargs=extra_kwargs(result))

    # A stream ends with a chunk that adds no text and carries the usage and statistics
    # (as OpenAI's final stream chunk does): callbacks and token counters read the last
    # response of a stream, and the usage is only known once the stream is exhausted.

    # ------------------------------------------------------------------ sync
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(self._run(self._completion_prompt(prompt, formatted), kwargs).run())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        run = self._run(self._completion_prompt(prompt, formatted), kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            try:
                for delta in run:
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)
            finally:
                run.close()
            yield self._completion(run.result, text, "")

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(self._run(to_core_messages(messages), kwargs).run())

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        run = self._run(to_core_messages(messages), kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            try:
                for delta in run:
                    text += delta
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            finally:
                run.close()
            yield self._chat_response(run.result, text, "")

        return gen()

    # ------------------------------------------------------------------ async
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(await self._run(self._completion_prompt(prompt, formatted), kwargs).arun())

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        run = self._run(self._completion_prompt(prompt, formatted), kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async with aclosing(run.astream()) as deltas:
                async for delta in deltas:
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)
            yield self._completion(run.result, text, "")

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat_response(await self._run(to_core_messages(messages), kwargs).arun())

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        run = self._run(to_core_messages(messages), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async with aclosing(run.astream()) as deltas:
                async for delta in deltas:
                    text += delta
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            yield self._chat_response(run.result, text, "")

        return gen()
