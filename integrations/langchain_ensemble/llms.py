"""``EnsembleLLM``: the ensemble as a LangChain text-completion model (``BaseLLM``).

A plain string prompt is sent to the core as *one user message*, so every member formats
it with its own chat template (template-less members use the core's fallback
transcript). That is what instruction-tuned members expect; it also means the response
continues an assistant turn, not the raw prompt text. Everything else (parameters,
metadata, timeout, cancellation) is shared with :class:`~langchain_ensemble.ChatEnsemble`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, closing
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import Runnable

from ensemble_core import Ensemble, GenerationResult
from ensemble_core.serving.runtime import Run

from .base import EnsembleFields, response_metadata, usage_metadata


def _generation_info(result: GenerationResult, ensemble: Ensemble, model_name: str, usage: bool = True) -> dict[str, Any]:
    info = response_metadata(result, ensemble, model_name)
    return {**info, "usage_metadata": usage_metadata(result)} if usage else info


def _llm_output(results: list[GenerationResult], model_name: str) -> dict[str, Any]:
    """Token usage summed over the prompts of one ``generate`` call."""
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {"model_name": model_name,
            "token_usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


class EnsembleLLM(EnsembleFields, BaseLLM):
    """A text-completion model backed by an ensemble (see :class:`ChatEnsemble` for the options).

    ``batch`` / ``abatch`` run each prompt as its own ``invoke``, concurrently (``Runnable.batch``, as
    :class:`ChatEnsemble` does), so the core shares their forward passes and, with
    ``return_exceptions=True``, one bad prompt is its own item's error. (``BaseLLM.batch`` sends all
    prompts to one ``generate``: they ran one after another, and one prompt's error was every item's.)
    ``generate`` over several prompts runs them one after another. ``_stream`` reports every chunk to
    ``on_llm_new_token`` itself, because ``BaseLLM.stream`` does not.
    """

    def batch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
              **kwargs: Any) -> list[str]:
        return Runnable.batch(self, inputs, config, return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: list[Any], config: Any = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[str]:
        return await Runnable.abatch(self, inputs, config, return_exceptions=return_exceptions, **kwargs)

    @property
    def _llm_type(self) -> str:
        return "ensemble"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._ensemble_identifying_params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        return self._ensemble_ls_params("llm", stop, kwargs)

    # ------------------------------------------------------------------ sync
    @staticmethod
    def _chunks(run: Run, ensemble: Ensemble, model_name: str,
                run_manager: CallbackManagerForLLMRun | None, usage: bool = True) -> Iterator[GenerationChunk]:
        """One chunk per committed delta, then a closing chunk with the metadata and (unless ``stream_usage=False``) usage."""
        with closing(iter(run)) as deltas:  # leaving early cancels the core stream
            for delta in deltas:
                chunk = GenerationChunk(text=delta)
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert run.result is not None
        last = GenerationChunk(text="", generation_info=_generation_info(run.result, ensemble, model_name, usage))
        if run_manager:
            run_manager.on_llm_new_token("", chunk=last)
        yield last

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        run, ensemble, model_name = self._prepare(prompt, stop, kwargs)
        yield from self._chunks(run, ensemble, model_name, run_manager, self._stream_usage(kwargs))

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        """All prompts, one after another on the shared ensemble (streamed when ``streaming``)."""
        results, generations, model_name = [], [], ""
        for prompt in prompts:
            run, ensemble, model_name = self._prepare(prompt, stop, kwargs)
            if self.streaming:
                for _ in self._chunks(run, ensemble, model_name, run_manager):
                    pass
                result = run.result
            else:
                result = run.run()
            assert result is not None
            results.append(result)
            generations.append([Generation(text=result.text, generation_info=_generation_info(result, ensemble, model_name))])
        return LLMResult(generations=generations, llm_output=_llm_output(results, model_name))

    # ------------------------------------------------------------------ async
    @staticmethod
    async def _achunks(run: Run, ensemble: Ensemble, model_name: str,
                       run_manager: AsyncCallbackManagerForLLMRun | None, usage: bool = True) -> AsyncIterator[GenerationChunk]:
        async with aclosing(run.astream()) as deltas:  # generation runs in a worker thread
            async for delta in deltas:
                chunk = GenerationChunk(text=delta)
                if run_manager:
                    await run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        assert run.result is not None
        last = GenerationChunk(text="", generation_info=_generation_info(run.result, ensemble, model_name, usage))
        if run_manager:
            await run_manager.on_llm_new_token("", chunk=last)
        yield last

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        run, ensemble, model_name = self._prepare(prompt, stop, kwargs)
        async with aclosing(self._achunks(run, ensemble, model_name, run_manager, self._stream_usage(kwargs))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        """All prompts, one after another, each in a worker thread (the event loop stays free)."""
        results, generations, model_name = [], [], ""
        for prompt in prompts:
            run, ensemble, model_name = self._prepare(prompt, stop, kwargs)
            if self.streaming:
                async with aclosing(self._achunks(run, ensemble, model_name, run_manager)) as chunks:
                    async for _ in chunks:
                        pass
                result = run.result
            else:
                result = await run.arun()
            assert result is not None
            results.append(result)
            generations.append([Generation(text=result.text, generation_info=_generation_info(result, ensemble, model_name))])
        return LLMResult(generations=generations, llm_output=_llm_output(results, model_name))
