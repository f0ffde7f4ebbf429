"""``ChatEnsemble``: a LangChain chat model whose every token comes from an ensemble.

Shaped like ``langchain-huggingface``'s ``ChatHuggingFace``: convert the messages, call
the engine, wrap the answer and its metadata. Generation, stop strings, token counting
and cancellation are all :class:`ensemble_core.Ensemble`'s; see :mod:`.base` for how the
standard parameters map onto it and :mod:`.messages` for the message conversion.

Tool calling and structured output (shaped like ``langchain-ollama``'s ``ChatOllama``: both
in this module, converters at module level) are the core's ``tools`` / ``tool_choice`` /
``response_format`` options: :meth:`ChatEnsemble.bind_tools` binds OpenAI-style tool specs,
:meth:`ChatEnsemble.with_structured_output` binds a tool or a response format and adds
LangChain's own output parsers. A forced call or a schema is decoded under a grammar by
every member, so the output always parses unless ``max_tokens`` cuts it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, get_buffer_string
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel
from typing_extensions import is_typeddict

from ensemble_core import ConfigurationError, Ensemble, GenerationResult, InputError, InvalidOptionError
from ensemble_core.constraints.grammar import check_tools
from ensemble_core.constraints.schemas import json_schema_format, strict_tools
from ensemble_core.constraints.structured import structured_request
from ensemble_core.serving.runtime import ReplyChunk, asettle, settle

from .base import EnsembleFields, response_metadata, usage_metadata
from .messages import lc_call_deltas, lc_tool_calls, reply_content, to_core_messages

#: The ``method`` values of :meth:`ChatEnsemble.with_structured_output`.
StructuredMethod = Literal["json_schema", "function_calling", "json_mode"]


# ----------------------------------------------------------------------------- parsers
class _WholeReply:
    """Refuse a reply the token budget cut (``finish_reason == "length"``).

    LangChain's JSON parsers complete partial JSON (``parse_partial_json``), so a reply cut
    in the middle of a list would otherwise come back as an object the model never
    finished. ``invoke`` raises ``OutputParserException`` (``parsing_error`` with
    ``include_raw=True``); streams yield partial objects as LangChain's parsers always do.
    """

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        message = getattr(result[0], "message", None) if result else None
        if not partial and message is not None and message.response_metadata.get("finish_reason") == "length":
            raise OutputParserException(
                "The reply was cut by the token budget (finish_reason='length') before its JSON was complete; "
                f"raise max_tokens. Reply: {str(message.content)[:200]!r}", llm_output=str(message.content))
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


class WholePydanticOutputParser(_WholeReply, PydanticOutputParser):
    """``PydanticOutputParser`` that refuses a reply cut by the token budget."""


class WholeJsonOutputParser(_WholeReply, JsonOutputParser):
    """``JsonOutputParser`` that refuses a reply cut by the token budget."""


class WholePydanticToolsParser(_WholeReply, PydanticToolsParser):
    """``PydanticToolsParser`` that refuses a reply cut by the token budget."""


class WholeJsonOutputKeyToolsParser(_WholeReply, JsonOutputKeyToolsParser):
    """``JsonOutputKeyToolsParser`` that refuses a reply cut by the token budget."""


# ----------------------------------------------------------------------------- converters
def convert_tools(tools: Sequence[Any], strict: bool | None = None) -> list[dict[str, Any]]:
    """LangChain tools (``BaseTool``, functions, pydantic classes, TypedDicts, dicts) → OpenAI tool specs.

    Objects in the parameters are closed (``additionalProperties: false`` where the schema
    does not say) unless ``strict=False``: a small model left free to add keys spends its
    budget on them, and a function accepts only the parameters it declares. An explicit
    ``additionalProperties`` is kept. (The core closes the top level of a call's arguments
    in any case.)
    """
    if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidOptionError("tools", tools, "a list of tools (BaseTool, functions, pydantic classes or dicts)")
    specs = []
    for i, tool in enumerate(tools):
        combined = [k for k in ("anyOf", "oneOf", "allOf", "$ref") if isinstance(tool, Mapping) and k in tool]
        if combined and "properties" not in tool and "function" not in tool and "parameters" not in tool:
            # convert_to_openai_tool keeps only such a schema's title and description: the call's arguments
            # would be `{}` whatever the schema says
            raise InvalidOptionError(f"tools[{i}]", tool, f"a JSON Schema with 'properties' at its top level (a "
                                     f"tool's arguments are one object; this one's top level is {combined[0]!r}): "
                                     "wrap it in an object property, or use with_structured_output(schema, "
                                     "method='json_schema'), which takes any schema")
        try:
            specs.append(convert_to_openai_tool(tool, strict=strict))
        except (ValueError, TypeError) as exc:
            raise InvalidOptionError(f"tools[{i}]", tool, f"a tool LangChain can convert to an OpenAI spec ({exc})") from exc
    return strict_tools(specs, strict)


def tool_choice_option(tool_choice: Any) -> str | dict[str, Any] | None:
    """LangChain's ``tool_choice`` values → the core's: ``None``/``False``/"auto" → auto (no option),
    ``True``/"any"/"required" → a call of any tool, a name or ``{"type": "function", "function":
    {"name": ...}}`` → that tool, "none" → no call."""
    if tool_choice is None or tool_choice is False or tool_choice == "auto":
        return None
    if tool_choice is True:
        return "required"
    if isinstance(tool_choice, (str, Mapping)):
        return tool_choice if isinstance(tool_choice, str) else dict(tool_choice)
    raise InvalidOptionError("tool_choice", tool_choice, "'auto', 'none', 'any', 'required', True, a tool name or "
                                                         "{'type': 'function', 'function': {'name': ...}}")


def schema_kind(schema: Any) -> str:
    """``"pydantic"``, ``"typeddict"`` or ``"dict"``; anything else raises :class:`InvalidOptionError`."""
    if isinstance(schema, type) and (is_basemodel_subclass(schema) or _is_pydantic_v1(schema)):
        return "pydantic"
    if is_typeddict(schema):
        return "typeddict"
    if isinstance(schema, Mapping):
        return "dict"
    raise InvalidOptionError("schema", schema, "a pydantic class, a TypedDict or a JSON Schema dict")


def _is_pydantic_v1(schema: type) -> bool:
    try:
        from pydantic.v1 import BaseModel as BaseModelV1
    except ImportError:  # pragma: no cover
        return False
    return issubclass(schema, BaseModelV1)


def json_schema_of(schema: Any, kind: str) -> dict[str, Any]:
    """The JSON Schema of a pydantic class (its own ``model_json_schema``), a TypedDict or a dict."""
    if kind == "pydantic":
        return schema.model_json_schema() if issubclass(schema, BaseModel) else schema.schema()
    if kind == "typeddict":
        return convert_to_json_schema(schema)
    return dict(schema)


def response_format_for(schema: Any, kind: str, strict: bool | None) -> dict[str, Any]:
    """The core ``response_format`` of :meth:`ChatEnsemble.with_structured_output` (``method="json_schema"``)."""
    json_schema = json_schema_of(schema, kind)
    return json_schema_format(json_schema, getattr(schema, "__name__", None), strict)


class ChatEnsemble(EnsembleFields, BaseChatModel):
    """A chat model backed by a training-free ensemble of local LLMs (SAFE, SpecEM, ...).

    Example:
        .. code-block:: python

            from langchain_ensemble import ChatEnsemble

            llm = ChatEnsemble(members=["smollm2-135m-instruct", "gemma3-270m"], method="safe",
                               max_tokens=64)
            llm.invoke("Name the capital of France.").content

    Weights and the ensemble object are shared by every instance with the same members,
    method and config (see :mod:`ensemble_core.serving.runtime`), so building a new
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
        """Limits of the whole ensemble: its context window is the smallest member's.

        Tool calling, tool choice and structured output are the core's (grammar-constrained
        when a call is forced or a schema is given, and from its start to its end when the
        ensemble starts a call by itself); tool calls are streamed as ``tool_call_chunks`` while
        their arguments are decoded, so ``tool_call_streaming`` is True.
        """
        ensemble = self._core_ensemble()
        return ModelProfile(
            name=ensemble.name, max_input_tokens=ensemble.context_window, text_inputs=True, text_outputs=True,
            image_inputs=False, audio_inputs=False, video_inputs=False, pdf_inputs=False, tool_calling=True,
            tool_choice=True, tool_call_streaming=True, structured_output=True, temperature=True,
        )

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Prompt tokens exactly as a call counts them: the primary member's chat-formatted prompt
        (with the tools, rendered as that member receives them).

        A list no call would take on its own (none, only system text, only empty text) is still
        counted, as LangChain counts any model's messages (the sum of each message's text tokens):
        ``trim_messages(token_counter=chat)`` counts such pieces of a history (``[]``, the system
        message alone) while it decides what fits, and raised before.
        """
        if not messages:
            return 0
        primary = self._core_ensemble().method.primary
        request = check_tools(convert_tools(tools)) if tools else None
        try:
            core = to_core_messages(messages)
            # encoded as a call encodes them (control-token strings in the contents count as text)
            ids = primary.encode_messages(primary.messages(core, request), request)
        except InputError:
            if not all(isinstance(m, BaseMessage) for m in messages):
                raise
            return sum(self.get_num_tokens(get_buffer_string([m])) for m in messages)
        return len(ids)

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
                   tool_choice: str | bool | dict[str, Any] | None = None, *, strict: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools: each call sends them to the members and reads the reply as calls.

        Args:
            tools: ``BaseTool``s, functions, pydantic classes, TypedDicts or OpenAI-style dicts
                (converted with ``convert_to_openai_tool``).
            tool_choice: ``None`` / ``"auto"`` (the ensemble decides: a reply that is a JSON
                call is a call, anything else is text), ``"any"`` / ``"required"`` / ``True`` (a
                call of one of the tools, decoded under a grammar), a tool name or
                ``{"type": "function", "function": {"name": ...}}`` (that tool), ``"none"``.
            strict: ``None``/``True`` (default): the objects of the tools' parameters are closed
                (no undeclared properties, where the schema does not say); ``False``: as given.
            kwargs: other options bound with the tools (``max_tokens``, ...).

        Unknown tool names in ``tool_choice`` and parameters the grammar cannot compile raise
        here, typed (:class:`~ensemble_core.errors.UnknownToolError`,
        :class:`~ensemble_core.errors.InvalidSchemaError`).
        """
        specs = convert_tools(tools, strict)
        choice = tool_choice_option(tool_choice)
        check_tools(specs, choice)
        if choice is not None:
            kwargs["tool_choice"] = choice
        return super().bind(tools=specs, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type | None = None, *,
                               method: StructuredMethod = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """A runnable that answers with an instance of ``schema`` (or a dict).

        Args:
            schema: a pydantic class (the result is an instance), a TypedDict or a JSON Schema
                dict (the result is a dict). Optional only for ``method="json_mode"``.
            method: ``"json_schema"`` (default: the schema is the core's ``response_format``,
                every member decodes under its grammar), ``"function_calling"`` (the schema is a
                tool the ensemble is forced to call), ``"json_mode"`` (any JSON object; the schema
                is neither enforced nor shown to the model: ask for the keys in the prompt).
            include_raw: return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.
            strict: ``None`` (default) or ``True``: every object of the schema is closed
                (``additionalProperties: false`` where the schema does not say); ``False``: the
                schema as given (JSON Schema's default then allows extra keys).

        The parsers are LangChain's own, as in its provider packages: ``PydanticOutputParser`` /
        ``JsonOutputParser`` for ``json_schema`` and ``json_mode``, ``PydanticToolsParser`` /
        ``JsonOutputKeyToolsParser`` (first tool only) for ``function_calling``; each refuses
        a reply cut by ``max_tokens`` (``OutputParserException``) instead of completing its
        partial JSON.
        """
        if kwargs:
            raise ConfigurationError(f"Unknown argument(s) {', '.join(sorted(kwargs))} for with_structured_output; "
                                     "accepted: schema, method, include_raw, strict.")
        if method not in ("json_schema", "function_calling", "json_mode"):
            raise InvalidOptionError("method", method, "'json_schema', 'function_calling' or 'json_mode'")
        if schema is None and method != "json_mode":
            raise InvalidOptionError("schema", schema, f"a pydantic class, a TypedDict or a JSON Schema dict for "
                                                       f"method={method!r} (only 'json_mode' works without one)")
        kind = None if schema is None else schema_kind(schema)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method, "strict": strict}, "schema": schema}}
        parser: OutputParserLike
        if method == "function_calling":
            tool = convert_tools([schema], strict)[0]
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, **trace)
            parser = (WholePydanticToolsParser(tools=[schema], first_tool_only=True) if kind == "pydantic"
                      else WholeJsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            if method == "json_mode":
                response_format: dict[str, Any] = {"type": "json_object"}
            else:
                response_format = response_format_for(schema, str(kind), strict)
            structured_request(response_format=response_format)  # a bad schema raises here, typed
            if method == "json_schema":
                from ensemble_core.constraints.grammar import JsonConstraint

                JsonConstraint(response_format["json_schema"]["schema"])
            llm = self.bind(response_format=response_format, **trace)
            parser = WholePydanticOutputParser(pydantic_object=schema) if kind == "pydantic" else WholeJsonOutputParser()
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")

    # ------------------------------------------------------------------ results
    @staticmethod
    def _metadata(result: GenerationResult, ensemble: Ensemble, model_name: str) -> dict[str, Any]:
        """``response_metadata``, with the calls that did not run: invalid ones, and repeats of answered calls."""
        metadata = response_metadata(result, ensemble, model_name)
        structured = result.structured
        if structured is not None and structured.invalid_tool_calls:
            metadata["invalid_tool_calls"] = list(structured.invalid_tool_calls)
        if structured is not None and structured.repeated_tool_calls:
            metadata["repeated_tool_calls"] = [c.as_dict() for c in structured.repeated_tool_calls]
        return metadata

    @classmethod
    def _result_message(cls, result: GenerationResult, ensemble: Ensemble, model_name: str) -> AIMessage:
        calls, invalid = lc_tool_calls(result.structured)
        return AIMessage(content=reply_content(result.text, result.structured), tool_calls=calls,
                         invalid_tool_calls=invalid, usage_metadata=usage_metadata(result),
                         response_metadata=cls._metadata(result, ensemble, model_name))

    @classmethod
    def _chunk(cls, reply: ReplyChunk, ensemble: Ensemble, model_name: str, usage: bool = True) -> ChatGenerationChunk:
        """A stream chunk for one piece of the core's reply: text, tool-call pieces (the last one closes
        the message)."""
        if reply.result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=reply.delta,
                                                              tool_call_chunks=lc_call_deltas(reply.calls)))
        return cls._last_chunk(reply.result, ensemble, model_name, reply.delta, reply.calls, usage)

    @classmethod
    def _last_chunk(cls, result: GenerationResult, ensemble: Ensemble, model_name: str, rest: str = "",
                    calls: Sequence[Any] = (), usage: bool = True) -> ChatGenerationChunk:
        """The closing chunk: the held-back text and the closing call pieces, the metadata and (unless
        ``stream_usage=False``) the usage, counted once."""
        return ChatGenerationChunk(message=AIMessageChunk(
            content=rest, tool_call_chunks=lc_call_deltas(calls), usage_metadata=usage_metadata(result) if usage else None,
            response_metadata=cls._metadata(result, ensemble, model_name), chunk_position="last"))

    # ------------------------------------------------------------------ sync
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        run.run()
        result = settle(run)
        return ChatResult(generations=[ChatGeneration(message=self._result_message(result, ensemble, model_name))],
                          llm_output={"model_name": model_name})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        """One chunk per committed text delta, then a closing chunk with usage and metadata.

        The core's :meth:`~ensemble_core.serving.runtime.Run.replies` decides what is shown when:
        with tools bound, text that is (or may still become) a tool call is held back, and a call's
        ``tool_call_chunks`` arrive while it is decoded (:func:`~langchain_ensemble.messages.lc_call_deltas`).
        ``run_manager`` is given only on
        paths where LangChain does not report tokens itself (``stream()`` reports each yielded
        chunk), so each chunk is reported once.
        """
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        usage = self._stream_usage(kwargs)
        for reply in run.replies():  # leaving early cancels the core stream
            chunk = self._chunk(reply, ensemble, model_name, usage)
            if run_manager:
                run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ async
    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        """Runs in a worker thread; cancelling the awaiting task stops the generation."""
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        await run.arun()
        result = await asettle(run)
        return ChatResult(generations=[ChatGeneration(message=self._result_message(result, ensemble, model_name))],
                          llm_output={"model_name": model_name})

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """Like :meth:`_stream`, with the model running in a worker thread (the loop stays free)."""
        run, ensemble, model_name = self._prepare(to_core_messages(messages), stop, kwargs)
        usage = self._stream_usage(kwargs)
        async for reply in run.areplies():
            chunk = self._chunk(reply, ensemble, model_name, usage)
            if run_manager:
                await run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk
