"""``ChatEnsemble``: a LangChain chat model whose every token comes from an ensemble.

Shaped like ``langchain-huggingface``'s ``ChatHuggingFace``: convert the messages, call
the engine, wrap the answer and its metadata. Generation, stop strings, token counting
and cancellation are all :class:`ensemble_core.Ensemble`'s; see :mod:`.base` for how the
standard parameters map onto it and :mod:`.messages` for the message conversion.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from ensemble_core import Ensemble, GenerationResult

from .base import EnsembleFields, response_metadata, usage_metadata
from .messages import to_core_messages


class ChatEnsemble(EnsembleFields, BaseChatModel):
    """A chat model backed by a training-free ensemble of local LLMs (SAFE, SpecEM, ...).

    Example:
        .. code-block:: python

            from langchain_ensemble import ChatEnsemble

            llm = ChatEnsemble(members=["smollm2-135m-instruct", "gemma3-270m"], method="safe",
                               max_tokens=64)
            llm.invoke("Name the capital of France.").content

    Weights and the ensemble object are shared by every instance with the same members,
    method and config (see :mod:`ensemble_core.runtime`), so building a new
    ``ChatEnsemble`` per request is cheap.

    ``usage_metadata`` counts tokens with the method's *primary* member's tokenizer (SAFE:
    the drafter; other methods: the first member): input tokens are that member's
    chat-formatted prompt, output tokens the returned text. In a stream, the last chunk
    alone carries ``usage_metadata`` and ``response_metadata``.
    """

    @property
    def _llm_type(self) -> str:
        return "ensemble-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._ensemble_identifying_params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        return self._ensemble_ls_params("chat", stop, kwargs)

    def _resolve_model_profile(self) -> ModelProfile | None:
        """Limits of the whole ensemble: its context window is the smallest member's."""
        ensemble = self._core_ensemble()
        return ModelProfile(
            name=ensemble.name, max_input_tokens=ensemble.context_window, text_inputs=True, text_outputs=True,
            image_inputs=False, audio_inputs=False, video_inputs=False, pdf_inputs=False, tool_calling=False,
            structured_output=False, temperature=True,
        )

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Prompt tokens exactly as a call counts them: the primary member's chat-formatted prompt."""
        if tools:
            raise NotImplementedError("ChatEnsemble does not support tools.")
        primary = self._core_ensemble().method.primary
        return len(primary.encode_prompt(primary.render(to_core_messages(messages))))

    # ------------------------------------------------------------------ results
    @staticmethod
    def _result_message(result: GenerationResult, ensemble: Ensemble, model_name: str) -> AIMessage:
        return AIMessage(content=result.text, usage_metadata=usage_metadata(result),
                         response_metadata=response_metadata(result, ensemble, model_name))

    @staticmethod
    def _last_chunk(result: GenerationResult, ensemble: Ensemble, model_name: str) -> ChatGenerationChunk:
        """The closing chunk: no text, all the usage and metadata (so they are counted once)."""
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, ensemble, model_name), chunk_position="last"))

    # ------------------------------------------------------------------ sync
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        result = run.run()
        return ChatResult(generations=[ChatGeneration(message=self._result_message(result, ensemble, model_name))],
                          llm_output={"model_name": model_name})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """One chunk per committed text delta, then a closing chunk with usage and metadata.

        ``run_manager`` is given only on paths where LangChain does not report tokens
        itself (``stream()`` reports each yielded chunk), so each chunk is reported once.
        """
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        with closing(iter(run)) as deltas:  # leaving early cancels the core stream
            for delta in deltas:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert run.result is not None
        last = self._last_chunk(run.result, ensemble, model_name)
        if run_manager:
            run_manager.on_llm_new_token("", chunk=last)
        yield last

    # ------------------------------------------------------------------ async
    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        """Runs in a worker thread; cancelling the awaiting task stops the generation."""
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        result = await run.arun()
        return ChatResult(generations=[ChatGeneration(message=self._result_message(result, ensemble, model_name))],
                          llm_output={"model_name": model_name})

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """Like :meth:`_stream`, with the model running in a worker thread (the loop stays free)."""
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        async with aclosing(run.astream()) as deltas:
            async for delta in deltas:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert run.result is not None
        last = self._last_chunk(run.result, ensemble, model_name)
        if run_manager:
            await run_manager.on_llm_new_token("", chunk=last)
        yield last
