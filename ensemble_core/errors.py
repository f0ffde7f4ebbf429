"""Every typed error of the library, in one module (as httpx keeps its exceptions).

Every error names the problem *and* the fix, so that a user of a LangChain chain or a
LlamaIndex query engine sees something actionable instead of a shape error deep inside
torch. The hierarchy is small on purpose: catch :class:`EnsembleError` for everything,
or one of the families (configuration, model loading, input, cancellation)::

    EnsembleError
    ├── ConfigurationError (ValueError)
    │   ├── InvalidOptionError
    │   ├── UnknownOptionError
    │   ├── NoMembersError
    │   ├── UnsupportedAttentionError
    │   ├── UnsupportedModelError
    │   ├── UnsupportedTokenizerError
    │   └── NotPicklableError (TypeError)
    ├── ModelLoadError (RuntimeError)
    │   ├── UnknownAliasError (KeyError)
    │   └── MissingDependencyError (ImportError)
    ├── InputError (ValueError)
    │   ├── PromptTooLongError
    │   ├── UnsupportedContentError
    │   ├── StateLostError
    │   ├── UnsupportedParameterError
    │   └── ConstraintError
    │       ├── InvalidSchemaError
    │       │   └── UnsupportedSchemaFeatureError
    │       └── UnknownToolError (KeyError)
    ├── GenerationCancelled
    │   ├── GenerationTimeout (TimeoutError)
    │   └── ClientDisconnected
    ├── MemberUnavailableError (RuntimeError)
    └── ApiError

Every exception class of the library is defined here and nowhere else (the architecture
test checks it); import them from ``ensemble_core`` or ``ensemble_core.errors``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Unpickle an error without calling its ``__init__`` (whose signature is not ``args``)."""
    error = cls.__new__(cls)
    BaseException.__init__(error, *args)
    error.__dict__.update(state)
    return error


class EnsembleError(Exception):
    """Base class of every error raised by ``ensemble_core``.

    Errors pickle with their message and attributes (a worker process or a Ray actor sends
    them back as raised), although most subclasses build the message from fields.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class ConfigurationError(EnsembleError, ValueError):
    """An option value or a combination of options is invalid."""


class InvalidOptionError(ConfigurationError):
    """One option has a value outside its allowed range or set."""

    def __init__(self, option: str, value: object, expected: str) -> None:
        self.option, self.value, self.expected = option, value, expected
        super().__init__(f"Invalid value for {option!r}: {value!r}. Expected {expected}.")


class UnknownOptionError(ConfigurationError):
    """Options were named that nothing takes (a typo would otherwise be silently ignored).

    The message names each, suggests the closest known name where one is close, and lists what
    ``owner`` accepts (``accepted``: that list in words, when it is more than ``known``).
    """

    def __init__(self, names: Iterable[str], owner: str, known: Iterable[str], accepted: str | None = None) -> None:
        self.names, self.owner, self.known = sorted(names), owner, sorted(known)
        guesses = [f"{name} -> {match[0]}" for name in self.names
                   if (match := difflib.get_close_matches(name, self.known, n=1, cutoff=0.75))]
        hint = f" Did you mean: {'; '.join(guesses)}?" if guesses else ""
        listing = accepted if accepted is not None else f"Known: {', '.join(self.known)}."
        super().__init__(f"Unknown option(s) {', '.join(self.names)} for {owner}.{hint} {listing}")


class NoMembersError(ConfigurationError):
    """An ensemble was built with too few members."""

    def __init__(self, got: int = 0, need: int = 1) -> None:
        super().__init__(
            f"An ensemble needs at least {need} member(s), got {got}. Pass members=[...] with "
            "aliases (e.g. 'smollm2-135m-instruct', 'gemma3-270m'), Hugging Face ids, local "
            "directories, GGUF files or (model, tokenizer) pairs."
        )


class NotPicklableError(ConfigurationError, TypeError):
    """A framework model object (``ChatEnsemble``, LlamaIndex's ``EnsembleLLM``) holds loaded models.

    ``Member`` objects, ``(model, tokenizer)`` pairs and an ``Ensemble`` carry weights and running
    threads: a pickle would have to copy both. Members given by name pickle (the unpickled object
    loads them, once per process); ``copy.deepcopy`` shares the loaded models instead of copying them.
    """

    def __init__(self, owner: str, loaded: Iterable[str]) -> None:
        self.owner, self.loaded = owner, list(loaded)
        super().__init__(
            f"Cannot pickle this {owner}: it holds loaded models ({', '.join(self.loaded)}), and a pickle would have "
            "to copy their weights and running threads. Give the members by name (aliases, local paths, Hugging Face "
            "ids or MemberSpec): those pickle, and the unpickled object loads them once per process. Within one "
            "process, share the object or copy it with copy.deepcopy (which shares the loaded models).")


class ModelLoadError(EnsembleError, RuntimeError):
    """A member's model or tokenizer could not be loaded."""


class UnknownAliasError(ModelLoadError, KeyError):
    """A member was named by something that is neither an alias, a path nor a usable id."""

    def __init__(self, name: str, known: list[str], suggestion: str | None = None, reason: str | None = None) -> None:
        self.name, self.suggestion = name, suggestion
        hint = f"Did you mean {suggestion!r}? " if suggestion else ""
        why = reason or ("not a Hugging Face model id available offline or reachable now")
        super().__init__(
            f"Unknown member {name!r}: it is not a built-in alias ({', '.join(sorted(known))}), "
            f"not an existing local directory or .gguf file, and {why}. {hint}Fix the spelling, pass a path, "
            "or download the model first (then HF_HUB_OFFLINE=1 loads it from the local cache)."
        )

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0])


class MissingDependencyError(ModelLoadError, ImportError):
    """An optional package needed for the requested feature is not installed."""

    def __init__(self, package: str, needed_for: str, install: str | None = None) -> None:
        self.package = package
        hint = install or f"pip install {package}"
        super().__init__(f"The package {package!r} is needed for {needed_for}. Install it: {hint}")


class UnsupportedAttentionError(ConfigurationError):
    """A verifier's attention implementation would ignore the verify-in-line mask."""

    def __init__(self, member: str, implementation: str) -> None:
        self.member, self.implementation = member, implementation
        super().__init__(
            f"Member {member!r} uses attn_implementation={implementation!r}, which ignores the custom 4-D "
            "attention mask that verify-in-line needs (candidates would see each other). Load it with "
            "attn_implementation='sdpa' (or 'eager'), e.g. MemberSpec(source, attn_implementation='sdpa'), "
            "or do not use it as a verifier."
        )


class UnsupportedModelError(ConfigurationError):
    """A model whose attention layout verify-in-line cannot mask exactly."""


class InputError(EnsembleError, ValueError):
    """A prompt, message list or call argument cannot be processed.

    ``param``: the request field at fault where the core knows it (``"tools"``, ``"tool_choice"``,
    ``"response_format"``; None: the prompt or messages), the ``param`` of the server's error.
    """

    param: str | None = None


class UnsupportedContentError(InputError):
    """A message holds non-text content (image, audio, file...): the members are text-only."""


class PromptTooLongError(InputError):
    """The prompt does not fit into a member's context window."""

    def __init__(self, member: str, prompt_tokens: int, max_new_tokens: int, window: int, hint: str = "") -> None:
        self.member = member
        self.prompt_tokens, self.max_new_tokens, self.window = prompt_tokens, max_new_tokens, window
        self.hint = hint  # what the caller's framework can change (an adapter adds it)
        super().__init__(
            f"The prompt is {prompt_tokens} tokens for member {member!r}, and with "
            f"max_new_tokens={max_new_tokens} it exceeds that member's context window of {window} "
            "tokens. Shorten the prompt, lower max_new_tokens, or drop that member." + (f" {hint}" if hint else "")
        )


class GenerationCancelled(EnsembleError):
    """Generation was stopped from outside (a cancelled async task or a closed stream)."""


class GenerationTimeout(GenerationCancelled, TimeoutError):
    """A generation ran past its ``timeout``; it was stopped, not retried."""

    def __init__(self, timeout: float, text_so_far: str = "") -> None:
        self.timeout, self.text_so_far = timeout, text_so_far
        super().__init__(
            f"The ensemble did not finish within timeout={timeout} s and was stopped "
            f"({len(text_so_far)} characters were generated). Raise `timeout`, lower `max_tokens`, "
            "or use fewer / smaller members."
        )


class ConstraintError(InputError):
    """A constrained-decoding request (JSON Schema, tool call) cannot be honoured as given."""


class InvalidSchemaError(ConstraintError):
    """A JSON Schema is malformed or uses a keyword the grammar engine cannot enforce."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"Invalid JSON Schema for constrained output: {problem}. {fix}")


class UnknownToolError(ConstraintError, KeyError):
    """A tool choice names a tool that is not among the tools passed."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name, self.known = name, list(known)
        super().__init__(
            f"tool_choice names {name!r}, which is not one of the tools passed ({', '.join(known)}). "
            "Fix the name, add that tool, or pass 'required' to allow any of them."
        )

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0])


class UnsupportedTokenizerError(ConfigurationError):
    """A member's tokenizer cannot be used for constrained decoding."""


class MemberUnavailableError(EnsembleError, RuntimeError):
    """A member running on a Ray actor died, lost its state or did not answer in time.

    ``member`` and ``node`` say which one and where; ``reason`` what happened. The request
    that hit it cannot continue (the member's decoding state is gone or in doubt), but the
    actor is restarted by Ray (``max_restarts``) and reloads its model, so retrying the
    request is the fix for a one-off failure (the default ``fix``). An actor dead for good
    (no restart left, or of an earlier Ray session) gets its own ``fix``: build the Ensemble
    again, which places a fresh actor.
    """

    def __init__(self, member: str, node: str, reason: str, fix: str | None = None) -> None:
        self.member, self.node, self.reason = member, node, reason
        hint = fix or (
            "Retry the request: Ray restarts the actor (RayOptions.max_restarts) and it reloads its model. "
            "If it keeps failing, look at the node (`ray status`, `ray logs`; out of memory is the usual cause) "
            "or raise RayOptions.call_timeout_s for slow models."
        )
        super().__init__(f"Member {member!r} on Ray node {node} {reason}. {hint}")


class StateLostError(InputError):
    """A Ray member's actor holds no decoding state of that id: it was restarted (or the state freed).

    Raised inside the actor; the caller (:mod:`ensemble_core.remote.cluster`) turns it into
    :class:`MemberUnavailableError`, which says what to do.
    """


class ApiError(EnsembleError):
    """An error answer of ``ensemble serve``, in OpenAI's shape (``status``, ``type``, ``param``, ``code``).

    The server (:mod:`ensemble_core.server.app`) maps every other error to one of these
    (``api_error``) and sends :meth:`body` with ``status``; an OpenAI client raises its own
    typed error from it (``BadRequestError`` for 400, ...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UnsupportedParameterError(InputError):
    """A request field the server or the core cannot honour (the server's 400 ``unsupported_parameter``)."""

    def __init__(self, param: str, why: str) -> None:
        self.param = param
        super().__init__(f"Unsupported parameter {param!r}: {why}.")


class ClientDisconnected(GenerationCancelled):
    """The HTTP client went away before its answer was complete (the server stops that generation)."""


class UnsupportedSchemaFeatureError(InvalidSchemaError):
    """A JSON Schema is valid but uses a feature the library cannot enforce or check (``feature`` names it).

    Raised when tools or a response format are checked (``structured_request``, ``check_tools``,
    a constraint being made), never when a reply is read: a keyword the grammar engine does not
    implement (``not``, ``if``/``then``/``else``, ``uniqueItems``, look-around in a ``pattern``), or a
    ``$ref`` to another document, which the argument validator would have to fetch over the
    network. The fix says how to write the schema instead.
    """

    def __init__(self, feature: str, problem: str, fix: str) -> None:
        self.feature = feature
        super().__init__(problem, fix)
