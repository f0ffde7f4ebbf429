"""Reliability: how much each member's vote counts, in every ensemble method.

Why: the published methods count every member alike (UniTE / GaC average uniformly, SpecEM's
Hedge starts uniform, generate-then-select sums the judges' scores), so adding a weak member
to a strong one lowers the answers silently. Measured on the bundled trio (GSM8K, 50
questions, docs/benchmarks.md "A weak member"): Qwen2.5-Coder-0.5B alone 8/50, every trio
row 0-3/50 under uniform votes, because SmolLM2-135M and Gemma-3-270m (a base model with no
chat template) outvote Qwen wherever they agree.

What counts as evidence, and what it costs (the comparison is in docs/choosing.md):

* **The prior** (the default, ``reliability="prior"``), known before decoding and free: a
  member weighs in proportion to its *body size* (:func:`body_parameters`: the parameters
  of its transformer layers, without the embeddings and the output head, read off its
  config), and a member without its own chat template, which reads a chat prompt through
  the fallback transcript, weighs ``template_penalty`` (0.25) times that
  (:func:`prior_weights`). On the trio: SmolLM2 0.22, Gemma-3 0.05, Qwen 0.73. On a request
  that involves tools (offers them, or answers after tool results: :func:`uses_tools`), a
  member whose template does not render them (it reads them as instructions in the system
  prompt, and the calls and results as plain turns) pays ``template_penalty`` once more
  (:func:`fallback_formats`): the Qwen pair 0.07 / 0.93 instead of 0.23 / 0.77. Why: in the
  agent suite (docs/agents.md) SmolLM2's vote was what turned Qwen's calls wrong where they
  differed (``element_symbol("Na")`` for "the symbol of sodium", an answer without the tool),
  and SmolLM2 reads the tools in a format it was never trained on.
* **Calibration** (``reliability_weights``, from :func:`calibrate`): every member answers a
  few of the user's questions alone; a member far below the best (less than ``keep`` of
  its accuracy) loses its vote, the others weigh by accuracy: the "determine-then-ensemble"
  step of UniTE, which ensembles only members of comparable strength. It costs one
  single-model answer per member and question, once.
* **Online, while answering**: SpecEM's Hedge goes on re-weighting its verifiers from
  verification wins, starting from these weights instead of uniform. Measured and not used
  as a default elsewhere: verification wins (SpecEM's recorded Hedge weights gave SmolLM2 the
  most weight on 30 of 50 trio questions), agreement with the others (the weak members'
  agreement is what outvotes the strong one) and the prompt's perplexity (PackLLM; it ranked
  the three members at random); a member's own confidence ranked Qwen first but follows a
  member's sharpness as much as its correctness.

Every method takes the same option group (:class:`~ensemble_core.options.ReliabilityOptions`)
and reads its weights from :func:`member_weights`: SAFE for the fusion at a point and the
consensus average, every-token for its fusion, SpecEM for Hedge's starting weights,
generate-then-select for the judges' weights. An explicit ``fusion_weights`` (SAFE,
every-token) wins; ``reliability="none"`` keeps the published uniform votes.

:class:`Votes` keeps one request's weights and each member's *wins* (decisions where the
member's own first choice was committed); the stats report both per member
(``members[i]["weight"]``, ``members[i]["wins"]``) so that a weak member is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.decoding.members import Member
from ensemble_core.decoding.stats import MemberStats
from ensemble_core.errors import InvalidOptionError
from ensemble_core.methods.single import SingleModel
from ensemble_core.options import reliability_mode
from ensemble_core.text.chat import Prompt, has_tool_messages, normalize_messages
from ensemble_core.text.distributions import fusion_weights

#: A calibrated member keeps its vote while its accuracy is at least this share of the best's.
CALIBRATION_KEEP = 0.5


# ============================================================================ the prior
def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def body_parameters(member: Member) -> int:
    """The parameters of ``member``'s transformer layers, without embeddings and output head.

    Read off the config of a dense decoder (attention ``d * head_dim * (2 * heads + 2 *
    kv_heads)`` plus a gated MLP ``3 * d * intermediate``, times the layers), so that it works
    for members whose weights live elsewhere (Ray actors) or are quantized; otherwise the
    model's parameters minus its input and output embeddings. Why not all parameters: a
    large vocabulary (Gemma-3's 262k rows are 170 of its 268 M) does not make a model reason
    better; the body is what scaling laws count (SmolLM2 106 M, Gemma-3 100 M, Qwen2.5 358 M).
    """
    model = member.model
    cfg = _text_config(model)
    d = getattr(cfg, "hidden_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    ffn = getattr(cfg, "intermediate_size", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if all(isinstance(v, int) and v > 0 for v in (d, layers, ffn, heads)):
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or d // heads
        return int(layers * (d * head_dim * (2 * heads + 2 * kv) + 3 * d * ffn))
    params = getattr(model, "parameters", None)
    if not callable(params):
        return 1
    skip = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None and hasattr(m, "weight")}
    return max(1, sum(p.numel() for p in params() if id(p) not in skip))


def has_chat_template(member: Member) -> bool:
    """Whether ``member`` renders chat prompts with its own template (else the fallback transcript)."""
    return bool(member.chat_template or getattr(member.tokenizer, "chat_template", None))


def fallback_formats(member: Member, tools: bool = False) -> int:
    """How many of a request's formats ``member`` reads through the library's fallback, not its own template.

    The chat (no chat template: the fallback transcript) and, when the request involves tools
    (``tools``: :func:`uses_tools`), the tools (``member.native_tools`` false: their
    definitions and the call format go into the system prompt as instructions,
    :func:`~ensemble_core.constraints.structured.tool_instructions`, and the history's calls and
    results become plain turns). Either is a format the member was not trained on; the prior
    multiplies its weight by ``template_penalty`` once per such format.
    """
    return int(not has_chat_template(member)) + int(tools and not member.native_tools)


def prior_weights(members: Sequence[Member], template_penalty: float = 0.25, tools: bool = False) -> list[float]:
    """Weights from what is known before decoding: body size, times ``template_penalty`` per format the
    member reads through a fallback (:func:`fallback_formats`: the chat, and the tools when ``tools``)."""
    raw = [body_parameters(m) * template_penalty ** fallback_formats(m, tools) for m in members]
    total = sum(raw)
    return [r / total for r in raw]


def uses_tools(config: Any, prompt: Prompt | None = None) -> bool:
    """Whether a request involves tools: ``config`` offers them (any tool choice but ``"none"``), or
    ``prompt``'s conversation holds tool calls or results (an agent's answer turn, tools or not)."""
    structured = getattr(config, "structured", None)
    if structured is not None and structured.tools and structured.choice != "none":
        return True
    return prompt is not None and not isinstance(prompt, str) and has_tool_messages(normalize_messages(prompt))


# ============================================================================ a request's weights
@dataclass(frozen=True)
class Weights:
    """The members' weights for one request: ``values`` sum to 1 (member order); ``source`` says where
    they come from (``"fusion_weights"``, ``"reliability_weights"``, ``"prior"`` or ``"none"``)."""

    values: tuple[float, ...]
    source: str

    @property
    def uniform(self) -> bool:
        return len(set(self.values)) <= 1

    def tensor(self) -> torch.Tensor | None:
        """For the fusion: None when every member weighs the same, so that uniform votes run the
        published (unweighted) arithmetic exactly."""
        return None if self.uniform else torch.tensor(self.values)

    def of(self, indices: Sequence[int]) -> list[float]:
        """The weights of a subset of the members (SpecEM's verifiers), renormalised; uniform if all are 0."""
        sub = [self.values[i] for i in indices]
        total = sum(sub)
        if total <= 0 or len(set(sub)) <= 1:
            return [1.0 / len(sub)] * len(sub)  # exactly the published uniform start
        return [w / total for w in sub]


def member_weights(members: Sequence[Member], config: Any, prompt: Prompt | None = None) -> Weights:
    """Every member's weight under ``config``: ``fusion_weights`` if given, else ``reliability_weights``,
    else the prior (``reliability="prior"``; for the request of ``prompt``: :func:`uses_tools`) or
    uniform (``"none"``)."""
    names = [m.name for m in members]
    explicit = getattr(config, "fusion_weights", None)
    if explicit is not None:
        return Weights(tuple(fusion_weights(explicit, names).tolist()), "fusion_weights")  # type: ignore[union-attr]
    calibrated = getattr(config, "reliability_weights", None)
    if calibrated is not None:
        try:
            values = fusion_weights(calibrated, names)
        except InvalidOptionError as exc:
            raise InvalidOptionError("reliability_weights", calibrated, exc.expected) from None
        return Weights(tuple(values.tolist()), "reliability_weights")  # type: ignore[union-attr]
    if reliability_mode(config) == "none":
        return Weights(tuple(1.0 / len(members) for _ in members), "none")
    return Weights(tuple(prior_weights(members, config.template_penalty, uses_tools(config, prompt))), "prior")


def check_weights(members: Sequence[Member], config: Any) -> None:
    """Raise now (a method's construction) what :func:`member_weights` would raise at the first request:
    ``fusion_weights`` / ``reliability_weights`` that name no member, or give another count than the members."""
    if getattr(config, "fusion_weights", None) is not None or getattr(config, "reliability_weights", None) is not None:
        member_weights(members, config)


@dataclass
class Votes:
    """One request's weights and wins, reported per member in the stats (:meth:`annotate`).

    ``wins[i]``: decisions (SAFE's ensemble points, every-token's steps, SpecEM's segments,
    generate-then-select's one choice) where member ``i``'s own first choice was committed.
    ``weights`` may change during a request (SpecEM's Hedge): the stats report the last.
    """

    weights: list[float]
    source: str
    wins: list[int] = field(default_factory=list)
    decisions: int = 0
    #: Wins counted by :meth:`count`, kept as a tensor where the probabilities live, so that a decision
    #: costs no read back to the host (added to ``wins`` when the stats are written).
    _counted: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def start(cls, weights: Weights) -> Votes:
        return cls(list(weights.values), weights.source, [0] * len(weights.values))

    def count(self, member_probs: torch.Tensor, chosen: int) -> None:
        """One decision among candidates: ``member_probs[m, c]`` is member ``m``'s probability of
        candidate ``c``; every member whose most likely candidate is ``chosen`` wins it."""
        self.decisions += 1
        won = (member_probs.argmax(dim=1) == chosen).to(torch.int64)
        self._counted = won if self._counted is None else self._counted + won

    def win(self, member: int) -> None:
        """One decision won by ``member`` alone (a chosen segment or answer)."""
        self.decisions += 1
        self.wins[member] += 1

    def annotate(self, members: list[MemberStats]) -> list[MemberStats]:
        """``members`` with each one's final weight and wins filled in."""
        if self._counted is not None:
            self.wins = [w + c for w, c in zip(self.wins, self._counted.tolist())]
            self._counted = None
        for stats, weight, wins in zip(members, self.weights, self.wins):
            stats.weight, stats.wins = round(weight, 6), wins
        return members


# ============================================================================ calibration
def calibrate(members: Sequence[Member], questions: Sequence[Any], answers: Sequence[str],
              correct: Callable[[str, str], bool], keep: float = CALIBRATION_KEEP,
              max_new_tokens: int = 256, **options: Any) -> dict[str, float]:
    """Weights measured on the user's own questions: ``{member name: weight}`` for ``reliability_weights``.

    Every member answers every question alone (greedy, ``max_new_tokens``, ``options`` as
    for any request: ``stop`` ...); ``correct(output, answer)`` judges an answer (for
    numbers, :func:`ensemble_core.bench.datasets.score` does what GSM8K expects). A member's
    accuracy is smoothed (``(correct + 1) / (n + 2)``, so that 0 of 5 is not certainty); a
    member below ``keep`` times the best member's loses its vote (weight 0: the UniTE
    paper's rule of ensembling only members of comparable strength), the others weigh their
    smoothed accuracy. Cost: ``len(members) * len(questions)`` single-model answers, once.
    """
    if len(questions) != len(answers) or not questions:
        raise InvalidOptionError("questions", len(questions), f"a non-empty list with one answer each ({len(answers)})")
    scores = {}
    for member in members:
        alone = SingleModel([member], max_new_tokens=max_new_tokens, **options)
        hits = sum(bool(correct(alone.generate(q).text, a)) for q, a in zip(questions, answers))
        scores[member.name] = (hits + 1) / (len(questions) + 2)
    return calibrated_weights(scores, keep)


def calibrated_weights(accuracy: Mapping[str, float], keep: float = CALIBRATION_KEEP) -> dict[str, float]:
    """``accuracy`` per member turned into weights: below ``keep`` times the best, 0; else the accuracy."""
    best = max(accuracy.values())
    return {name: (a if a >= keep * best else 0.0) for name, a in accuracy.items()}
