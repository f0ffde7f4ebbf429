"""``EnsembleLLM``: a LlamaIndex LLM whose every answer is produced by an ensemble.

The class is thin on purpose, like ``HuggingFaceLLM``: metadata, message conversion and
the sync / async / streaming plumbing. All generation logic (SAFE, SpecEM, the
baselines, stop strings, cancellation, token counting) lives in
:class:`ensemble_core.Ensemble`, which the LangChain adapter wraps too.

Threading (see :mod:`ensemble_core.serving.runtime`): the core's generation is a blocking iterator (one method
round per step). The async methods run it in a worker thread, so the event loop keeps
serving other tasks; cancelling the awaiting task sets the core stream's cancel event and
the worker stops after the round it is in.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Dict, List, Type, Union

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
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_serializer
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.program.utils import process_streaming_objects
from llama_index.core.types import Model, PydanticProgramMode

from ensemble_core import (
    DEFAULT_MEMBERS,
    ConfigurationError,
    Ensemble,
    GenerationResult,
    InvalidOptionError,
    Member,
    PromptTooLongError,
)
from ensemble_core.constraints.grammar import check_tools
from ensemble_core.constraints.schemas import json_schema_format, strict_tools
from ensemble_core.constraints.structured import reply_content
from ensemble_core.serving.runtime import (
    Run,
    asettle,
    call_overrides,
    collect_method_options,
    deepcopy_memo,
    merge_options,
    reduce_by_constructor,
    settle,
    shared_ensemble,
)
from ensemble_core.text.chat import Prompt, normalize_tool_call

from .messages import INVALID_CALL, assistant_message, extra_kwargs, raw_payload, to_core_messages

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

dispatcher = get_dispatcher(__name__)

#: Options that are EnsembleLLM fields; method_config must not set them a second time.
LLM_OPTIONS = ("max_new_tokens", "stop", "temperature", "do_sample")
#: LlamaIndex's usual constructor names for EnsembleLLM fields.
FIELD_ALIASES = {"max_tokens": "max_new_tokens", "num_output": "max_new_tokens"}
#: Program options of LlamaIndex's function-calling path that mean nothing to a schema's answer.
PROGRAM_OPTIONS = ("tool_required", "tool_choice", "allow_parallel_tool_calls")
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


class EnsembleLLM(FunctionCallingLLM):
    """Several local models answering as one LlamaIndex LLM (a function-calling one).

    ``Settings.llm = EnsembleLLM(members=["smollm2-135m-instruct", "gemma3-270m"], method="safe")``
    makes every query engine, chat engine and agent use the ensemble. Each member sees the
    conversation through its own chat template; responses carry token usage in
    ``raw["usage"]`` (``TokenCountingHandler`` reads it) and the method's statistics in
    ``additional_kwargs["ensemble_stats"]``.

    Constructor: the fields below; ``max_tokens`` (LlamaIndex's usual name) is
    ``max_new_tokens``; any config field of the method (``lookahead=3`` for SAFE) goes
    into ``method_config``; anything else raises :class:`~ensemble_core.ConfigurationError`.
    Invalid values raise the library's errors too (``ConfigurationError`` chained to
    pydantic's ``ValidationError``). Completion calls send the prompt as one user message
    through the chat path, so both behave alike.

    Tools (``FunctionAgent``, ``predict_and_call``) are the core's ``tools`` / ``tool_choice``: a
    required call (``tool_required=True``, a ``tool_choice`` name) is decoded under a grammar by
    every member, so it always parses unless ``max_new_tokens`` cuts it; with
    ``tool_choice="auto"`` a call the ensemble starts is completed under its grammar, anything
    else is text. Calls come back as ``ToolCallBlock``s. Structured output (``structured_predict``
    and its stream / async forms, ``as_structured_llm``, ``FunctionAgent(output_cls=...)``) is
    the output class's JSON value decoded under its schema (the core's ``response_format``);
    ``pydantic_program_mode="function"`` takes LlamaIndex's forced-call program instead.

    Not the LangChain class of the same name: ``langchain_ensemble.EnsembleLLM`` is a
    LangChain ``BaseLLM`` (text completion); this one is a LlamaIndex ``LLM`` (chat and
    completion). Each package exports the name its framework's users look for.
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
    context_window: int | None = Field(
        default=None, gt=0, description="Window LlamaIndex fits prompts into (default: the smallest member window "
                                        "minus context_margin); at most the smallest member window.")
    context_margin: int | None = Field(
        default=None, ge=0, description="Tokens kept free below the smallest member window (default: window/8 + 64)."
    )

    _ensemble: Ensemble = PrivateAttr()

    def __init__(self, **data: Any) -> None:
        data = _collect_options(data)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigurationError(f"Invalid EnsembleLLM options: {exc}") from exc
        reserved = sorted(set(self.method_config) & set(LLM_OPTIONS))
        if reserved:
            raise ConfigurationError(
                f"method_config sets {', '.join(reserved)}: pass these as EnsembleLLM fields "
                "(max_new_tokens=, stop=, temperature=) instead, so that there is one place for them."
            )
        self._ensemble = shared_ensemble(self.members, self.method, self.method_config, self.member_options)
        window = self._ensemble.context_window
        if self.context_window is not None and self.context_window > window:
            raise ConfigurationError(f"context_window={self.context_window} exceeds the smallest member window "
                                     f"({window} tokens); pass at most {window}.")
        self._overrides({})  # validates stop / temperature against the core's rules once, here

    @classmethod
    def class_name(cls) -> str:
        return "EnsembleLLM"

    @field_serializer("members")
    def _serialize_members(self, members: List[Any]) -> List[str]:
        return [m.name if isinstance(m, Member) else str(m) for m in members]

    def __deepcopy__(self, memo: Dict[int, Any] | None = None) -> Any:
        """A deep copy that shares the loaded models and the running ensemble (copying them would double
        the weights; their threads and locks cannot be copied): :func:`deepcopy_memo`."""
        memo = {} if memo is None else memo
        memo.update(deepcopy_memo(self.members, self._ensemble))
        return super().__deepcopy__(memo)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the values it was built with and rebuilt by its constructor on load, where members
        given by name load once per process; loaded ones raise :class:`~ensemble_core.NotPicklableError`
        (LlamaIndex's own pickling dropped them with a warning, and the copy ran the default members)."""
        return reduce_by_constructor(self, self.members)

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
            context_window=self.context_window or max(window - margin, 1),
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._ensemble.name,
            system_role=MessageRole.SYSTEM,
        )

    # ------------------------------------------------------------------ options
    def _overrides(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Per-call generation options: the fields, overridden by the call's keyword arguments.

        The core's option policy (:func:`ensemble_core.serving.runtime.call_overrides`): a per-call
        ``stop`` replaces the field's, ``max_tokens`` is ``max_new_tokens``, temperature 0 is
        greedy, any other name must be a config field of the method.
        """
        fields = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "stop": self.stop}
        overrides = call_overrides(merge_options(fields, kwargs), self._ensemble.config, "EnsembleLLM",
                                   exclude={"do_sample"})
        overrides.setdefault("do_sample", False)
        return overrides

    def _run(self, prompt: Prompt, kwargs: Dict[str, Any]) -> Run:
        return Run(self._ensemble, prompt, self._overrides(kwargs))

    @contextmanager
    def _fitted(self) -> Iterator[None]:
        """A prompt too long for a member says what a LlamaIndex user can change: LlamaIndex packed it into
        ``metadata.context_window`` counting with its own tokenizer, which counts text in other languages
        (Russian: SmolLM2 needs 1.43x cl100k's tokens) or digits (1.78x) in far fewer tokens than the members."""
        try:
            yield
        except PromptTooLongError as exc:
            if exc.hint:
                raise
            hint = (f"LlamaIndex fitted the prompt into context_window={self.metadata.context_window} counting "
                    "with its own tokenizer (Settings.tokenizer, tiktoken by default), which may count this text in "
                    "fewer tokens than the member: set Settings.tokenizer = llm.token_ids (the members' primary "
                    "tokenizer), or a larger context_margin (or a smaller context_window) on EnsembleLLM.")
            raise PromptTooLongError(exc.member, exc.prompt_tokens, exc.max_new_tokens, exc.window, hint) from exc

    def token_ids(self, text: str) -> List[int]:
        """``text`` as the primary member's token ids (no special tokens): ``Settings.tokenizer = llm.token_ids``
        makes LlamaIndex count prompts as the member that reads them does (SAFE: the drafter; other methods:
        the first member), instead of with tiktoken's cl100k."""
        return self._ensemble.method.primary.text_ids(text)

    def _completion_messages(self, prompt: str, formatted: bool) -> list[dict[str, Any]]:
        """A completion prompt is one user message (see the class docstring)."""
        return [{"role": "user", "content": prompt if formatted else self.completion_to_prompt(prompt)}]

    # ------------------------------------------------------------------ one response path
    def _response(self, chat: bool, result: GenerationResult | None, text: str, delta: str | None) -> Any:
        """A chat or completion response; the final one (``result`` given) carries usage and stats,
        and, for a reply with tool calls, its calls as ``ToolCallBlock``s (``text`` is then the
        reply without the calls)."""
        extra: Dict[str, Any] = {}
        structured = None
        if result is not None:
            extra = {"raw": raw_payload(result, self._ensemble), "additional_kwargs": extra_kwargs(result)}
            structured = result.structured
        if chat:
            return ChatResponse(message=assistant_message(text, structured), delta=delta, **extra)
        return CompletionResponse(text=text, delta=delta, **extra)

    # A stream ends with a response that carries the usage and statistics (as OpenAI's final
    # stream chunk does): callbacks and token counters read the last response of a stream,
    # and the usage is only known once the stream is exhausted. With tools, text that is (or
    # may still become) a call is held back and the calls arrive in that last response.
    def _generate(self, prompt: Prompt, kwargs: Dict[str, Any], chat: bool) -> Any:
        run = self._run(prompt, kwargs)
        with self._fitted():
            run.run()
            result = settle(run)
        return self._response(chat, result, reply_content(result.text, result.structured), None)

    def _stream(self, prompt: Prompt, kwargs: Dict[str, Any], chat: bool) -> Iterator[Any]:
        run = self._run(prompt, kwargs)  # validated now, so that bad options raise at the call

        def gen() -> Iterator[Any]:
            with self._fitted():
                # call pieces have no place in a LlamaIndex response (its calls are blocks of the last one)
                for reply in run.replies():
                    if reply.delta or reply.result is not None:
                        yield self._response(chat, reply.result, reply.text, reply.delta)

        return gen()

    async def _agenerate(self, prompt: Prompt, kwargs: Dict[str, Any], chat: bool) -> Any:
        run = self._run(prompt, kwargs)
        with self._fitted():
            await run.arun()
            result = await asettle(run)
        return self._response(chat, result, reply_content(result.text, result.structured), None)

    async def _astream(self, prompt: Prompt, kwargs: Dict[str, Any], chat: bool) -> AsyncIterator[Any]:
        run = self._run(prompt, kwargs)

        async def gen() -> AsyncIterator[Any]:
            with self._fitted():
                async for reply in run.areplies():
                    if reply.delta or reply.result is not None:
                        yield self._response(chat, reply.result, reply.text, reply.delta)

        return gen()

    # ------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: Union[str, ChatMessage] | None = None,
        chat_history: List[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Union[str, Dict[str, Any]] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """The ``chat`` arguments for a call with tools: messages, OpenAI-style specs, the tool choice.

        ``tool_choice`` (a tool name, ``"auto"``, ``"none"``, ``"required"`` or OpenAI's dict)
        wins; otherwise ``tool_required=True`` forces a call of one of the tools and False
        lets the ensemble decide. An unknown tool name, or parameters the grammar engine
        cannot compile, raise here (typed: ``UnknownToolError``, ``InvalidSchemaError``).
        ``allow_parallel_tool_calls=False`` (LlamaIndex's default here; ``FunctionAgent`` passes True) is the
        core's ``parallel_tool_calls=False``: the reply ends after its first call. Objects in the
        parameters are closed (``additionalProperties: false`` where the schema does not say)
        unless ``strict=False``.
        """
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        specs = strict_tools(specs, strict)
        if tool_choice is None:
            tool_choice = "required" if tool_required and specs else "auto"
        if not isinstance(tool_choice, (str, Mapping)):
            raise InvalidOptionError("tool_choice", tool_choice, "a tool name, 'auto', 'none', 'required' or "
                                                                 "{'type': 'function', 'function': {'name': ...}}")
        check_tools(specs, tool_choice)
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg)
        return {"messages": messages, "tools": specs or None, "tool_choice": tool_choice if specs else None,
                "parallel_tool_calls": None if allow_parallel_tool_calls or not specs else False, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        """Without parallel calls, only the first call of the reply is kept (as LlamaIndex's OpenAI LLM does; the
        core already ended the reply there, this covers a reply decoded without the lazy grammar)."""
        if not allow_parallel_tool_calls:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            if len(calls) > 1:
                response.message.blocks = [b for b in response.message.blocks
                                           if not isinstance(b, ToolCallBlock) or b is calls[0]]
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> List[ToolSelection]:
        """The calls of a response: its ``ToolCallBlock``s, else OpenAI-style ``additional_kwargs["tool_calls"]``.

        A call that cannot run (cut by the token budget, or against its tool's schema) is never
        passed off as an answer: with ``error_on_no_tool_call`` (LlamaIndex's convention for
        programs and ``predict_and_call``) a response without a call that can run raises
        ``ValueError`` naming why; without it (``FunctionAgent``) such a call is returned as a
        selection of the reserved tool ``invalid_tool_call``, which no agent has, so the agent
        reports an error and asks again instead of ending its run on the broken call (the next
        request shows the member why its call failed: see :mod:`.messages`).
        """
        message = response.message
        calls: list[dict[str, Any]] = [{"id": b.tool_call_id, "name": b.tool_name, "arguments": b.tool_kwargs}
                                       for b in message.blocks if isinstance(b, ToolCallBlock)]
        if not calls:
            calls = [c.model_dump() if hasattr(c, "model_dump") else c
                     for c in message.additional_kwargs.get("tool_calls") or []]
        runnable = [c for c in calls if c.get("name") != INVALID_CALL]
        if not runnable and error_on_no_tool_call:
            text = repr((message.content or "")[:200])
            bad = [c for c in calls if c.get("name") == INVALID_CALL]
            if bad:
                first = bad[0]["arguments"] if isinstance(bad[0].get("arguments"), dict) else {}
                raise ValueError(f"Expected a tool call, but the ensemble's call of {first.get('name')!r} cannot run: "
                                 f"{first.get('error')}. Raise max_new_tokens if the budget cut it.")
            if (response.additional_kwargs or {}).get("finish_reason") == "length":
                raise ValueError(f"Expected a tool call, but the token budget cut the reply before the call was "
                                 f"complete: {text}. Raise max_new_tokens.")
            raise ValueError(f"Expected at least one tool call, but the ensemble answered in text: {text}. "
                             "Pass tool_required=True (or a tool_choice) to force a call.")
        selections = []
        for i, call in enumerate(calls):
            c = normalize_tool_call(call, f"Tool call {i}")
            selections.append(ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]))
        return selections

    # ------------------------------------------------------------------ structured output
    # ``structured_predict``, ``as_structured_llm`` and FunctionAgent's ``output_cls``: with the default
    # ``pydantic_program_mode`` the answer is the output class's JSON value, decoded under its schema (the
    # core's ``response_format``, closed as in strict mode), as LangChain's ``with_structured_output`` does;
    # ``pydantic_program_mode="function"`` keeps LlamaIndex's FunctionCallingProgram (a forced call of a
    # tool named after the class). Why: wrapped in a call (``{"name": "Product", "arguments": {...}}``) the
    # bundled members fill the fields worse (docs/agents.md, "Structured output in LlamaIndex": FunctionAgent
    # with ``output_cls`` wrote ``"value": 12`` for "12 times 34" as a call, 408 as a value).
    def _schema_chat(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                     llm_kwargs: Dict[str, Any] | None, prompt_args: Dict[str, Any]) -> tuple[list[ChatMessage], Dict[str, Any]]:
        """The messages and chat options that ask for one value of ``output_cls`` under its schema's grammar
        (LlamaIndex's start event sent, as its own programs do)."""
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        kwargs = {k: v for k, v in (llm_kwargs or {}).items() if k not in PROGRAM_OPTIONS}
        kwargs["response_format"] = json_schema_format(output_cls.model_json_schema(), name=output_cls.__name__)
        return messages, kwargs

    def _schema_value(self, output_cls: Type[BaseModel], response: ChatResponse) -> BaseModel:
        """The finished reply as an ``output_cls``; a reply the budget cut (or one the class's own validators
        refuse) raises ``ValueError`` naming why, as LlamaIndex's programs do."""
        text = response.message.content or ""
        if (response.additional_kwargs or {}).get("finish_reason") == "length":
            raise ValueError(f"The token budget cut the {output_cls.__name__} value before its JSON was complete "
                             f"({len(text)} characters: {text[:80]!r}...). Raise max_new_tokens (or pass "
                             "llm_kwargs={'max_tokens': ...}).")
        try:
            return output_cls.model_validate_json(text)
        except ValidationError as e:
            raise ValueError(f"The ensemble's answer is not a valid {output_cls.__name__}: {e}. It wrote: "
                             f"{text[:200]!r}") from e

    def _partials(self, output_cls: Type[BaseModel], response: ChatResponse,
                  objects: list[Any] | None) -> Any:
        """One streamed value: partial (a ``Flexible`` model while the JSON grows), the checked value at the end."""
        if "finish_reason" in (response.additional_kwargs or {}):  # the last response (see _response)
            return self._schema_value(output_cls, response)
        return process_streaming_objects(response, output_cls, cur_objects=objects)

    def _schema_mode(self) -> bool:
        return self.pydantic_program_mode == PydanticProgramMode.DEFAULT

    @dispatcher.span
    def structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                           llm_kwargs: Dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """One ``output_cls`` value for the formatted prompt, decoded under its schema (see above)."""
        if not self._schema_mode():
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._schema_chat(output_cls, prompt, llm_kwargs, prompt_args)
        value = self._schema_value(output_cls, self.chat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=value))
        return value  # type: ignore[return-value]

    @dispatcher.span
    async def astructured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: Dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """:meth:`structured_predict`, generated in a worker thread."""
        if not self._schema_mode():
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._schema_chat(output_cls, prompt, llm_kwargs, prompt_args)
        value = self._schema_value(output_cls, await self.achat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=value))
        return value  # type: ignore[return-value]

    @dispatcher.span
    def stream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                  llm_kwargs: Dict[str, Any] | None = None, **prompt_args: Any) -> Generator[Any, None, None]:
        """Partial values while the JSON grows (LlamaIndex's ``Flexible`` models), then the checked value."""
        if not self._schema_mode():
            return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._schema_chat(output_cls, prompt, llm_kwargs, prompt_args)
        responses = self.stream_chat(messages, **kwargs)  # bad options raise here, at the call

        def gen() -> Generator[Any, None, None]:
            value = None
            for response in responses:
                value = self._partials(output_cls, response, None if value is None else [value])
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=value))
                yield value
            dispatcher.event(LLMStructuredPredictEndEvent(output=value))

        return gen()

    @dispatcher.span
    async def astream_structured_predict(self, output_cls: Type[Model], prompt: BasePromptTemplate,
                                         llm_kwargs: Dict[str, Any] | None = None,
                                         **prompt_args: Any) -> AsyncGenerator[Any, None]:
        """:meth:`stream_structured_predict`, generated in a worker thread."""
        if not self._schema_mode():
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        messages, kwargs = self._schema_chat(output_cls, prompt, llm_kwargs, prompt_args)
        responses = await self.astream_chat(messages, **kwargs)

        async def gen() -> AsyncGenerator[Any, None]:
            value = None
            async for response in responses:
                value = self._partials(output_cls, response, None if value is None else [value])
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=value))
                yield value
            dispatcher.event(LLMStructuredPredictEndEvent(output=value))

        return gen()

    # ------------------------------------------------------------------ LlamaIndex API
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._generate(to_core_messages(messages), kwargs, chat=True)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(to_core_messages(messages), kwargs, chat=True)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._agenerate(to_core_messages(messages), kwargs, chat=True)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return await self._astream(to_core_messages(messages), kwargs, chat=True)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._generate(self._completion_messages(prompt, formatted), kwargs, chat=False)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(self._completion_messages(prompt, formatted), kwargs, chat=False)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._agenerate(self._completion_messages(prompt, formatted), kwargs, chat=False)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return await self._astream(self._completion_messages(prompt, formatted), kwargs, chat=False)


def _collect_options(data: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor keywords → fields: aliases renamed, method config fields moved into ``method_config``.

    ``EnsembleLLM(method="safe", lookahead=3)`` equals ``EnsembleLLM(method="safe",
    method_config={"lookahead": 3})``; a name that is neither a field, an alias nor a
    config field of the method raises, so that a typo is never silently ignored.
    """
    data = dict(data)
    for alias, name in FIELD_ALIASES.items():
        if alias in data:
            if name in data and data[name] != data[alias]:
                raise ConfigurationError(f"Pass {name} or {alias}, not both (they are the same option).")
            data[name] = data.pop(alias)
    return collect_method_options(data, set(EnsembleLLM.model_fields), data.get("method", "safe"), "EnsembleLLM",
                                  reserved=LLM_OPTIONS)
