"""What ChatEnsemble and EnsembleLLM share: their fields, and the mapping of LangChain's
standard parameters onto one core call.

The adapters are thin on purpose (like ``langchain-huggingface``'s ``ChatHuggingFace``):
they translate messages and metadata, and every token is produced by
:class:`ensemble_core.Ensemble`. This module holds the translation of parameters:

========================  ==========================================================
LangChain parameter       core
========================  ==========================================================
``members`` / ``model``   the members (``model`` = member names joined by ``"+"``)
``method``                ``Ensemble(method=...)``: ``"safe"``, ``"specem"``, ``"single"``...
``method_config`` and     the method's config fields (``lookahead``, ``segment_length``...);
unknown keyword args      names that are not config fields raise ConfigurationError
``temperature``           ``0``/``None`` → greedy; ``> 0`` → ``do_sample=True`` at that temperature
``max_tokens``            ``max_new_tokens`` (counted in the primary member's tokens)
``top_p``, ``seed``       the same config fields
``stop``                  ``stop`` (a per-call ``stop`` replaces the instance's, as in ChatOpenAI);
                          members' own stop strings (``"\\nUser:"`` for template-less
                          members) are always added by the core
``tools``,                the core's config fields of the same names (OpenAI-style specs, see
``tool_choice``,          ``ensemble_core.constraints.structured``); set by ``bind_tools`` /
``response_format``       ``with_structured_output`` (``chat_models``), or per call
(all of the above)        mapped by the core's option policy,
                          :func:`ensemble_core.serving.runtime.call_overrides`, shared with LlamaIndex
``timeout``               seconds; the core stream's cancel event is set at the deadline and
                          :class:`~ensemble_core.serving.runtime.GenerationTimeout` is raised
``max_retries``           accepted and validated, never used: local generation has no
                          transient (network, rate-limit) errors to retry, and repeating a
                          deterministic failure would only waste time
``streaming``             ``invoke`` goes through ``_stream`` (callbacks per chunk)
``stream_usage``          ``True`` / ``None`` (field or per call): a stream's last chunk carries the
                          usage; ``False`` leaves it out (as ``ChatOpenAI`` does)
``api_key``               accepted for drop-in compatibility with hosted chat models; local
                          members need no key and it is never read
========================  ==========================================================
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from langchain_core.runnables.config import RunnableConfig, ensure_config
from langchain_core.runnables.configurable import RunnableConfigurableFields
from langchain_core.runnables.utils import ConfigurableField
from langchain_core.utils.pydantic import get_fields
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from ensemble_core import (
    DEFAULT_MEMBERS,
    ConfigurationError,
    Ensemble,
    GenerationResult,
    InvalidOptionError,
)
from ensemble_core.options import check_int, check_number
from ensemble_core.serving.runtime import (
    Run,
    call_overrides,
    collect_method_options,
    deepcopy_memo,
    merge_options,
    reduce_by_constructor,
    result_info,
    shared_ensemble,
)
from ensemble_core.text.chat import Prompt

DEFAULT_METHOD = "safe"
PROVIDER = "ensemble"
#: Call-time keyword arguments that LangChain itself may forward and that carry no option.
_IGNORED_CALL_KWARGS = frozenset({"stream"})
#: Call-time keyword arguments that are not generation options.
_CALL_ONLY = frozenset({"timeout", "model", "stream_usage"})
#: The fields that say which ensemble runs. ``model_name`` and ``members`` are two spellings of the members;
#: ``ensemble`` replaces all of them.
_MEMBER_SET = frozenset({"members", "model_name"})
_ENSEMBLE_FIELDS = frozenset({"members", "model_name", "ensemble", "method", "method_config", "member_options"})


def split_model(model: str) -> list[str]:
    """``"a+b"`` → ``["a", "b"]``: the member list encoded in a ``model`` string."""
    parts = [p.strip() for p in model.split("+")]
    if not all(parts):
        raise InvalidOptionError("model", model, "member names joined by '+', e.g. 'smollm2-135m-instruct+gemma3-270m'")
    return parts


def check_stream_usage(value: Any) -> bool:
    """``stream_usage`` (ChatOpenAI's field and call keyword) → whether a stream's last chunk carries the usage.

    ``None`` (the default) and ``True`` include it: counting costs nothing here, unlike a hosted API's
    opt-in usage chunk. ``False`` leaves it out, as ``ChatOpenAI`` does.
    """
    if value is not None and not isinstance(value, bool):
        raise InvalidOptionError("stream_usage", value, "True, False or None (None: the last chunk of a stream "
                                 "carries usage_metadata)")
    return value is not False


def stale_fields(changed: set[str], current: Mapping[str, Any]) -> set[str]:
    """The fields of ``current`` (an instance's values) that ``changed`` fields make stale in a rebuild.

    A rebuild (``configurable_fields``, ``model_copy(update=...)``) passes every field again; the
    other spelling of a member set that changed no longer describes it: a new ``model`` replaces
    ``members`` (and a prebuilt ``ensemble``, keeping its method, as a per-call ``model=`` does), new
    ``members`` replace ``model`` (and ``ensemble``), a new ``ensemble`` replaces the members, the
    method and its config. ``model_name`` derived from the old members is stale in each case.
    """
    stale: set[str] = set()
    if changed & _MEMBER_SET:
        stale |= _MEMBER_SET | ({"ensemble"} if current.get("ensemble") is not None else set())
    if "ensemble" in changed:
        stale |= _ENSEMBLE_FIELDS
    return stale - changed


class _EnsembleConfigurableFields(RunnableConfigurableFields):
    """``RunnableConfigurableFields`` for the adapters: LangChain rebuilds the model from *all* its
    current field values plus the configured ones, so a configured ``model`` would come with the old
    ``members``; this drops the fields a configured value makes stale (:func:`stale_fields`)."""

    def _prepare(self, config: RunnableConfig | None = None) -> tuple[Any, RunnableConfig]:
        config = ensure_config(config)
        given = config.get("configurable", {})
        changed = {name for name, spec in self.fields.items()  # options specs always apply (their default)
                   if not isinstance(spec, ConfigurableField) or spec.id in given}
        stale = stale_fields(changed, self.default.__dict__)
        if not stale:
            return super()._prepare(config)
        default = copy.copy(self.default)  # only its __dict__ is read: the values passed to the rebuild
        for name in stale:
            default.__dict__.pop(name, None)
        return RunnableConfigurableFields(default=default, fields=self.fields)._prepare(config)


def usage_metadata(result: GenerationResult) -> dict[str, Any]:
    """LangChain ``UsageMetadata``; counted with the method's primary member's tokenizer (``cache_read``: the
    prompt tokens read from its prefix cache)."""
    return {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
            "total_tokens": result.total_tokens, "input_token_details": {"cache_read": result.cached_tokens}}


def response_metadata(result: GenerationResult, ensemble: Ensemble, model_name: str) -> dict[str, Any]:
    """What a response says about how it was made (see the README for each key)."""
    return {"model_name": model_name, "model_provider": PROVIDER, **result_info(result, ensemble)}


class EnsembleFields(BaseModel):
    """Fields and helpers shared by :class:`ChatEnsemble` and :class:`EnsembleLLM`."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())

    members: list[Any] | None = None
    """Aliases, local paths, GGUF files, Hugging Face ids, ``MemberSpec``s, prebuilt
    ``ensemble_core.Member`` objects or ``(model, tokenizer)`` pairs. ``None``: the bundled
    pair ``["smollm2-135m-instruct", "gemma3-270m"]``."""
    model_name: str | None = Field(default=None, alias="model")
    """The members as one string, names joined by ``"+"`` (``model=`` is the same field).
    Set from ``members`` when not given; reported as ``model_name`` in responses."""
    method: str = DEFAULT_METHOD
    """Ensemble method registered in ``ensemble_core.METHODS``."""
    method_config: dict[str, Any] = Field(default_factory=dict)
    """Fields of the method's config dataclass (e.g. SAFE's ``lookahead``)."""
    member_options: dict[str, Any] = Field(default_factory=dict)
    """Loading options for members given by name (``dtype``, ``device``, ``device_map``...)."""
    ensemble: Ensemble | None = Field(default=None, exclude=True)
    """A prebuilt ``ensemble_core.Ensemble``, instead of members / method / method_config."""
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    timeout: float | None = None
    max_retries: int | None = None
    streaming: bool = False
    stream_usage: bool | None = None
    """``True`` or ``None``: a stream's last chunk carries ``usage_metadata``; ``False`` leaves it out
    (ChatOpenAI's option)."""
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)

    _core: Ensemble | None = PrivateAttr(default=None)

    @field_validator("members", mode="before")
    @classmethod
    def _one_member_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) or not isinstance(value, (list, tuple, type(None))) else value

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**_collect_method_options(type(self), data))
        except ValidationError as exc:  # the library's own error, with pydantic's details chained
            raise ConfigurationError(f"Invalid {type(self).__name__} options: {exc}") from exc
        self._bind_ensemble()

    def configurable_fields(self, **kwargs: Any) -> Any:
        """LangChain's ``configurable_fields``, for any field, ``model`` / ``members`` / ``ensemble`` included:
        a configured member set replaces the instance's (:func:`stale_fields`)."""
        fields = super().configurable_fields(**kwargs)  # type: ignore[misc]  # checks the names
        return _EnsembleConfigurableFields(default=fields.default, fields=fields.fields)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Any:
        """A copy; with ``update``, built anew from the copied values like ``cls(**values)``, so the new
        values are validated and new members, method or config run (pydantic's copy would keep the old
        ensemble). ``update`` may name ``model`` for ``model_name``; a new member set replaces the other
        spelling of the old one (:func:`stale_fields`)."""
        if not update:
            return super().model_copy(deep=deep)
        aliases = {info.alias: name for name, info in type(self).model_fields.items() if info.alias}
        update = {aliases.get(k, k): v for k, v in update.items()}
        copied = super().model_copy(deep=deep)
        stale = stale_fields(set(update), copied.__dict__)
        values = {k: v for k, v in copied.__dict__.items() if k in type(self).model_fields and k not in stale}
        return type(self)(**{**values, **update})

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        """A deep copy that shares the loaded models and the running ensemble (copying them would double
        the weights; their threads and locks cannot be copied): :func:`deepcopy_memo`."""
        memo = {} if memo is None else memo
        memo.update(deepcopy_memo(self.members, self._core, ensemble=self.ensemble))
        return super().__deepcopy__(memo)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the values it was built with and rebuilt by its constructor on load, where members
        given by name load once per process; loaded ones raise :class:`~ensemble_core.NotPicklableError`."""
        return reduce_by_constructor(self, self.members, self.ensemble)

    # ------------------------------------------------------------------ construction
    def _bind_ensemble(self) -> None:
        """Resolve the ensemble (cached per process) and check every option once, here."""
        explicit = self.model_fields_set
        check_stream_usage(self.stream_usage)
        if self.ensemble is not None:  # empty values are no clash: a rebuild passes every field
            clash = {name for name in ("members", "method_config", "member_options")
                     if getattr(self, name) not in (None, {})}
            if clash or ("method" in explicit and self.method != self.ensemble.method_name):
                raise ConfigurationError(
                    f"Pass either ensemble= or {', '.join(sorted(clash or {'method'}))}=, not both: a prebuilt "
                    "Ensemble already has its members, method and config."
                )
            self.method = self.ensemble.method_name
        if self.model_name is not None and self.members is not None:
            self._check_model_names_members()
        ensemble = self._core_ensemble()
        if self.model_name is None:
            self.model_name = member_names(ensemble)
        check_number("timeout", self.timeout, 0, above=True, optional=True, expected="a number > 0.0 (or None)")
        check_int("max_retries", self.max_retries, 0, optional=True, expected="an integer >= 0 (or None)")
        ensemble.config.replace(**self._generation_overrides({}, None))  # validates the standard params

    def _check_model_names_members(self) -> None:
        """``model`` and ``members`` both given: ``model`` must be the members' names (as given, or as
        the built ensemble names them: what ``model_name`` is filled with, so a rebuild passes it)."""
        assert self.model_name is not None and self.members is not None
        members = list(self.members)
        if all(isinstance(m, str) for m in members) and split_model(self.model_name) == members:
            return
        error = ConfigurationError(
            f"model={self.model_name!r} names other members than members={self.members!r}. Pass one of "
            "them (model='a+b' is short for members=['a', 'b'])."
        )
        try:
            names = member_names(self._core_ensemble())
        except Exception as exc:  # members that do not load: the clash is the error to report
            raise error from exc
        if names != self.model_name:
            raise error

    def _core_ensemble(self) -> Ensemble:
        if self._core is None:
            if self.ensemble is not None:
                self._core = self.ensemble
            else:
                members = self.members
                if members is None:  # spelled out, so that the default shares the cache entry of the same list
                    members = split_model(self.model_name) if self.model_name is not None else list(DEFAULT_MEMBERS)
                self._core = shared_ensemble(members, self.method, self.method_config, self.member_options)
        return self._core

    # ------------------------------------------------------------------ per call
    def _ensemble_for(self, model: str | None) -> tuple[Ensemble, str]:
        """The ensemble for a call, honouring a per-call ``model="a+b"`` override."""
        own = self._core_ensemble()
        if model is None or model == self.model_name:
            return own, str(self.model_name)
        if not isinstance(model, str):
            raise InvalidOptionError("model", model, "member names joined by '+'")
        return shared_ensemble(split_model(model), own.method_name, self.method_config, self.member_options), model

    def _generation_overrides(self, kwargs: dict[str, Any], stop: list[str] | None,
                              ensemble: Ensemble | None = None) -> dict[str, Any]:
        """Instance values overridden by call values → core config overrides (the core's option policy)."""
        instance = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                    "seed": self.seed, "stop": self.stop}
        call = {k: v for k, v in kwargs.items() if k not in _CALL_ONLY}
        if stop is not None:
            call["stop"] = stop
        ensemble = ensemble or self._core_ensemble()
        return call_overrides(merge_options(instance, call), ensemble.config, type(self).__name__)

    def _stream_usage(self, kwargs: Mapping[str, Any]) -> bool:
        """Whether this call's stream ends with the usage (``stream_usage``: the call's value, else the field's)."""
        return check_stream_usage(kwargs.get("stream_usage", self.stream_usage))

    def _prepare(self, prompt: Prompt, stop: list[str] | None, kwargs: Mapping[str, Any]) -> tuple[Run, Ensemble, str]:
        """One core run for a call: ensemble, overrides, timeout. Unknown kwargs raise."""
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_CALL_KWARGS}
        check_stream_usage(kwargs.get("stream_usage", self.stream_usage))
        ensemble, model_name = self._ensemble_for(kwargs.get("model"))
        overrides = self._generation_overrides(dict(kwargs), stop, ensemble)
        timeout = kwargs.get("timeout", self.timeout)
        check_number("timeout", timeout, 0, above=True, optional=True, expected="a number > 0.0 (or None)")
        return Run(ensemble, prompt, overrides, timeout=timeout), ensemble, model_name

    # ------------------------------------------------------------------ tokens
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` in the primary member's own tokenizer (no special tokens).

        The primary member (SAFE: the drafter; other methods: the first member) is the one
        whose tokens ``max_tokens`` and ``usage_metadata`` count.
        """
        if getattr(self, "custom_get_token_ids", None) is not None:
            return self.custom_get_token_ids(text)  # type: ignore[misc]
        return self._core_ensemble().method.primary.text_ids(text)

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    # ------------------------------------------------------------------ tracing
    def _ensemble_ls_params(self, model_type: str, stop: list[str] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        model = kwargs.get("model")
        params: dict[str, Any] = {
            "ls_provider": PROVIDER,
            "ls_model_name": model if isinstance(model, str) else str(self.model_name),
            "ls_model_type": model_type,
        }
        temperature = kwargs.get("temperature", self.temperature)
        if isinstance(temperature, (int, float)):
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if isinstance(max_tokens, int):
            params["ls_max_tokens"] = max_tokens
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    @property
    def _ensemble_identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name, "method": self.method, "method_config": self.method_config,
            "member_options": self.member_options, "temperature": self.temperature, "max_tokens": self.max_tokens,
            "top_p": self.top_p, "seed": self.seed, "stop": self.stop,
        }


def member_names(ensemble: Ensemble) -> str:
    """The ``model_name`` of an ensemble: its members' names joined by ``"+"``."""
    return "+".join(m.name for m in ensemble.members)


def _collect_method_options(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Move keyword arguments that are method config fields into ``method_config``.

    ``ChatEnsemble(method="safe", lookahead=4)`` is the same as
    ``ChatEnsemble(method="safe", method_config={"lookahead": 4})``. Anything that is
    neither a field of the class nor a config field of the method raises.
    """
    known: set[str] = set()
    for name, info in get_fields(cls).items():
        known.add(name)
        if info.alias:
            known.add(info.alias)
    ensemble = data.get("ensemble")
    method = ensemble.method_name if isinstance(ensemble, Ensemble) else data.get("method", DEFAULT_METHOD)
    return collect_method_options(data, known, method, cls.__name__)
