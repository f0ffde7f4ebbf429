"""Options: the checks every config runs, and the option groups several methods share.

Every user-facing option of the library is a field of a frozen dataclass config
(:class:`~ensemble_core.decoding.generation.GenerationConfig` and the method configs that
extend it, :class:`~ensemble_core.decoding.scheduler.BatchingConfig`,
:class:`~ensemble_core.models.loading.MemberSpec`, ...), checked when the config is made, so a
wrong value fails where it was written and never half-way through a request. The checks are
strict on purpose: ``max_new_tokens="10"`` and ``True`` (a bool is an int in Python) are
refused, not converted, with an :class:`~ensemble_core.errors.InvalidOptionError` that names
the option, the value and what is expected.

Option groups are dataclass mixins a method config lists among its bases; each checks its
own fields, so a field shared by several methods is defined, documented and checked once:

* :class:`FusionOptions`: how members' distributions are fused (SAFE, every-token);
* :class:`PromptLookupOptions`: prompt-lookup drafting (SAFE, SpecEM, generate-then-select).

Checks run in ``__post_init__`` along the config's class hierarchy (:func:`next_post_init`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ensemble_core.errors import InvalidOptionError


# ----------------------------------------------------------------------------- value checks
def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool`` and not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def check_int(option: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              expected: str | None = None, optional: bool = False) -> int | None:
    """``value`` if it is an integer in ``[minimum, maximum]`` (None allowed when ``optional``), else a typed error."""
    if optional and value is None:
        return None
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        raise InvalidOptionError(option, value, expected or _range("an integer", minimum, maximum))
    return value


def check_number(option: str, value: Any, minimum: float | None = None, maximum: float | None = None, *,
                 above: bool = False, below: bool = False, finite: bool = False, expected: str | None = None,
                 optional: bool = False) -> float | None:
    """``value`` if it is a number in the range (``above`` / ``below``: open ends), else a typed error."""
    if optional and value is None:
        return None
    ok = is_number(value) and not (finite and not math.isfinite(value))
    if ok and minimum is not None:
        ok = value > minimum if above else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if below else value <= maximum
    if not ok:
        lo = None if minimum is None else ("(" if above else "[") + f"{minimum:g}"
        hi = None if maximum is None else f"{maximum:g}" + (")" if below else "]")
        default = ("a number in " + f"{lo}, {hi}" if lo and hi else
                   "a number " + (f"> {minimum:g}" if above else f">= {minimum:g}") if lo else
                   "a number " + (f"< {maximum:g}" if below else f"<= {maximum:g}") if hi else "a number")
        raise InvalidOptionError(option, value, expected or default)
    return value


def check_bool(option: str, value: Any, expected: str = "True or False", optional: bool = False) -> bool | None:
    """``value`` if it is a ``bool`` (None allowed when ``optional``), else a typed error."""
    if (optional and value is None) or isinstance(value, bool):
        return value
    raise InvalidOptionError(option, value, expected)


def check_choice(option: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a typed error listing them."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidOptionError(option, value, "one of " + ", ".join(choices))
    return value


def _range(kind: str, minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{kind} in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"{kind} >= {minimum}"
    if maximum is not None:
        return f"{kind} <= {maximum}"
    return kind


def next_post_init(cls: type, obj: Any) -> None:
    """Run the ``__post_init__`` that comes after ``cls``'s in ``obj``'s class hierarchy, if any.

    Why: a config lists option groups among its bases (``class SafeConfig(GenerationConfig,
    FusionOptions, PromptLookupOptions)``) and each checks its own fields, so every
    ``__post_init__`` hands on to the next one, as cooperative ``super()`` calls do.
    """
    after = getattr(super(cls, obj), "__post_init__", None)
    if after is not None:
        after()


# ----------------------------------------------------------------------------- per-device defaults
def device_type(device: Any) -> str:
    """``"cpu"``, ``"cuda"``, ``"mps"``...: the kind of a member's device (a ``torch.device``, ``"cuda:1"``, or a
    Ray member's ``"ray:<node>/<device>/<id>"``), the key of the measured defaults."""
    text = str(device)
    if text.startswith("ray:"):
        parts = text.split("/")
        text = parts[1] if len(parts) > 1 else ""
    return text.split(":")[0]


def device_default(value: Any, paper: Any, measured: Mapping[str, Any], device: Any, published: bool) -> Any:
    """An option's value for one request: ``value`` when given (not None); else the papers' ``paper``
    value under ``published=True``; else the value ``measured`` faster for the device's type without
    costing accuracy (docs/configuration.md), or the paper's where nothing was measured.

    Why per device: a lever that pays on a CPU (more tokens per pass of a small drafter) is
    untested on a GPU, and untested settings never become a user's default.
    """
    if value is not None:
        return value
    return paper if published else measured.get(device_type(device), paper)


# ----------------------------------------------------------------------------- fusion
#: The fusion rules (:mod:`ensemble_core.text.distributions` maps each to its class).
FUSION_RULES = ("unite", "gac")
#: How a fused distribution is sharpened before the choice.
SHARPENINGS = ("heuristic", "geometric", "none")
#: How UniTE scores a string that is not one of a member's tokens (:func:`sub_token_rule`).
SUB_TOKEN_RULES = ("once", "shared")
WEIGHTS_EXPECTED = ("None, a list with one weight >= 0 per member, or a {member name: weight} mapping "
                    "(members left out weigh 1); at least one weight > 0")


def _weight(value: Any, option: Any) -> float:
    if not is_number(value) or not 0 <= value < math.inf:
        raise InvalidOptionError("fusion_weights", option, WEIGHTS_EXPECTED)
    return float(value)


def normalize_weight_option(weights: Any) -> tuple[float, ...] | tuple[tuple[str, float], ...] | None:
    """Check ``fusion_weights`` as far as possible without the members; a hashable copy.

    A sequence becomes a tuple of floats, a mapping a tuple of ``(name, weight)`` pairs.
    How many members there are and what they are called is checked by
    :func:`~ensemble_core.text.distributions.fusion_weights` when a request starts.
    """
    if weights is None:
        return None
    if isinstance(weights, Mapping) or (isinstance(weights, tuple) and weights and all(
            isinstance(w, tuple) and len(w) == 2 and isinstance(w[0], str) for w in weights)):
        pairs = tuple(weights.items()) if isinstance(weights, Mapping) else weights
        if not pairs or not all(isinstance(name, str) for name, _ in pairs):
            raise InvalidOptionError("fusion_weights", weights, WEIGHTS_EXPECTED)
        return tuple((name, _weight(w, weights)) for name, w in pairs)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or not weights:
        raise InvalidOptionError("fusion_weights", weights, WEIGHTS_EXPECTED)
    values = tuple(_weight(w, weights) for w in weights)
    if not any(values):
        raise InvalidOptionError("fusion_weights", weights, WEIGHTS_EXPECTED)
    return values


#: The largest UniTE ``top_k``. Each candidate of the union is spelled in every member's vocabulary at every
#: ensemble point, in Python: past a few thousand that cost is seconds per token (measured: 4 tokens of tiny
#: members took 0.5 s at k=10 and 100, 3.2 s at 10,000, 24 s at 100,000, and a server passes the option
#: from any request). k beyond the vocabularies means the whole of them, which GaC is.
MAX_TOP_K = 1000


@dataclass(frozen=True)
class FusionOptions:
    """How the members' next-token distributions are fused (SAFE's ensemble points, every-token).

    ``distribution``: ``"unite"`` (the union of every member's top-k, UniTE) or ``"gac"``
    (the union vocabulary, GaC). ``top_k``: UniTE's k, and how many of the drafter's
    candidates prefix merge may lift. ``sharpening``: ``"heuristic"`` (prefix merge),
    ``"geometric"`` or ``"none"`` (the published baselines do not sharpen; SAFE's default
    is ``"heuristic"``). ``fusion_weights``: per-member weights of the fused distribution
    (None: uniform, as published; a list in member order or a ``{name: weight}`` mapping,
    members left out weigh 1). ``sub_tokens``: how UniTE scores a candidate string that is not
    one of a member's tokens, by the member's probability of the first token of its own
    encoding of the string: ``"shared"`` (published) gives that probability to every such
    string as well as to the token itself, ``"once"`` to one candidate only (the token's own
    text when it is a candidate, else the shortest such string); None: ``"once"``, ``"shared"``
    under ``published=True`` (:func:`sub_token_rule`).
    """

    distribution: str = "unite"
    top_k: int = 10
    sharpening: str = "none"
    fusion_weights: Any = None
    sub_tokens: str | None = None

    def __post_init__(self) -> None:
        next_post_init(FusionOptions, self)
        check_choice("distribution", self.distribution, FUSION_RULES)
        check_int("top_k", self.top_k, 1, MAX_TOP_K, expected=f"an integer from 1 to {MAX_TOP_K} (UniTE's k; published: "
                  "10). For the whole vocabularies use distribution='gac'")
        check_choice("sharpening", self.sharpening, SHARPENINGS)
        if self.sub_tokens is not None:  # None: the default, resolved per request (sub_token_rule)
            check_choice("sub_tokens", self.sub_tokens, SUB_TOKEN_RULES)
        object.__setattr__(self, "fusion_weights", normalize_weight_option(self.fusion_weights))


def sub_token_rule(config: Any) -> str:
    """``config``'s ``sub_tokens``, or when left at None the default: ``"shared"`` (the published UniTE
    scoring) under ``published=True``, ``"once"`` otherwise.

    Why ``"once"``: under the published rule a member's probability of a token also counts, whole, for
    every longer string that starts with it, so a string the member never meant ties with its own token
    and another member's vote appends it (measured in an agent: Qwen's 0.999 for ``ency`` went to
    SmolLM2's ``encycl`` too, SmolLM2 broke the tie, and Qwen wrote ``encyclod``; docs/agents.md).
    Resolved where it is read, as :func:`reliability_mode` is.
    """
    rule = getattr(config, "sub_tokens", None)
    if rule is None:
        return "shared" if getattr(config, "published", False) else "once"
    return str(rule)


# ----------------------------------------------------------------------------- prompt lookup
@dataclass(frozen=True)
class PromptLookupOptions:
    """Prompt-lookup drafting (:mod:`~ensemble_core.decoding.lookup`).

    ``prompt_lookup``: a drafter also feeds up to this many tokens guessed from its own
    context in each pass and keeps those it chooses anyway: the same draft in fewer passes
    (0: one token per pass, as published; transformers' ``prompt_lookup_num_tokens``; None,
    the default: the method's measured-best for the drafter's device, :func:`device_default`:
    SAFE 4 on a CPU, else 0).
    ``prompt_lookup_max_requests``: guess only while at most this many requests decode
    together (None: always); guesses cost compute in a batched pass
    (:func:`~ensemble_core.decoding.lookup.guesses_now`).
    """

    prompt_lookup: int | None = None
    prompt_lookup_max_requests: int | None = 1

    def __post_init__(self) -> None:
        next_post_init(PromptLookupOptions, self)
        check_int("prompt_lookup", self.prompt_lookup, 0, optional=True,
                  expected="an integer >= 0 (0: one token per pass), or None for the measured default")
        check_int("prompt_lookup_max_requests", self.prompt_lookup_max_requests, 1, optional=True,
                  expected="an integer >= 1, or None to guess at any number of concurrent requests")


# ----------------------------------------------------------------------------- reliability
#: Where a member's vote comes from (:mod:`ensemble_core.methods.reliability`).
RELIABILITY_MODES = ("prior", "none")
RELIABILITY_WEIGHTS_EXPECTED = ("None, a list with one weight >= 0 per member, or a {member name: weight} mapping "
                                "(members left out weigh 1; e.g. what methods.reliability.calibrate returns); "
                                "at least one weight > 0")


def reliability_mode(config: Any) -> str:
    """Where ``config``'s member weights come from: its ``reliability``, or when left at None the default,
    ``"none"`` under ``published=True`` and ``"prior"`` otherwise ("none" for a config without the option).

    Resolved where it is read, not stored back: a config re-made with ``dataclasses.replace`` (per-call
    overrides) would otherwise carry the first resolution as if it were given.
    """
    mode = getattr(config, "reliability", "none")
    if mode is None:
        return "none" if getattr(config, "published", False) else "prior"
    return str(mode)


@dataclass(frozen=True)
class ReliabilityOptions:
    """How much each member's vote counts (every ensemble method; :mod:`ensemble_core.methods.reliability`).

    ``reliability``: ``"prior"`` (default): each member weighs in proportion to its body
    size (parameters outside the embeddings and the output head), and a member without its
    own chat template, which answers a chat prompt through the fallback transcript, weighs
    ``template_penalty`` times that (on a request involving tools, offered or in the history, a
    member whose template does not render them: ``template_penalty`` once more); SpecEM's
    Hedge starts from these weights and goes on learning from verification. ``"none"``: every
    member weighs the same, as published (the default under ``published=True``).
    ``reliability_weights``: per-member weights measured on the user's own questions
    (:func:`~ensemble_core.methods.reliability.calibrate`; a list in member order or a
    ``{name: weight}`` mapping, members left out weigh 1); they replace the prior, a weight
    of 0 takes the member's vote away. An explicit ``fusion_weights`` (SAFE, every-token)
    wins over both.
    """

    reliability: str | None = None
    reliability_weights: Any = None
    template_penalty: float = 0.25

    def __post_init__(self) -> None:
        next_post_init(ReliabilityOptions, self)
        if self.reliability is not None:  # None: the default, resolved per request (reliability_mode)
            check_choice("reliability", self.reliability, RELIABILITY_MODES)
        check_number("template_penalty", self.template_penalty, 0, 1, above=True,
                     expected="a number in (0, 1] (1: a member reading the chat or the tools through the "
                              "fallback weighs as its size says)")
        try:
            weights = normalize_weight_option(self.reliability_weights)
        except InvalidOptionError:
            raise InvalidOptionError("reliability_weights", self.reliability_weights,
                                     RELIABILITY_WEIGHTS_EXPECTED) from None
        object.__setattr__(self, "reliability_weights", weights)
