"""Ensemble members: a model, its tokenizer, its chat format, its device, its decoding state.

A :class:`Member` is shared (weights are loaded once per process, see :func:`~ensemble_core.models.loading.load_objects`);
a :class:`DecodeState` is per request: the member's own token ids for
``prompt + response so far`` and a KV cache over them. All cross-member exchange goes
through text (see :mod:`ensemble_core.text.alignment`).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex  # named lists (a dependency of transformers)
import torch

from ensemble_core.constraints.structured import StructuredRequest, with_instructions
from ensemble_core.decoding.cache import can_crop_exactly, crop, new_cache
from ensemble_core.decoding.forward import Job, causal_job, choice, single_pass
from ensemble_core.decoding.prefix_cache import PrefixCache, placement
from ensemble_core.decoding.scheduler import Binding, current, run_job
from ensemble_core.decoding.static import StaticCache, StaticPasses, route
from ensemble_core.errors import (
    InputError,
    PromptTooLongError,
)
from ensemble_core.models.bundled import BUNDLED
from ensemble_core.models.loading import (
    DEFAULT_PREFIX_CACHE,
    MemberSpec,
    check_passes,
    check_prefix_cache,
    load_objects,
    member_spec,
)
from ensemble_core.text import alignment
from ensemble_core.text.chat import (
    FALLBACK_STOPS,
    Prompt,
    normalize_messages,
    render_chat,
    reply_lead,
    template_supports_tools,
)


class Member:
    """One model of an ensemble, with everything needed to decode with it incrementally."""

    def __init__(self, model: Any, tokenizer: Any, name: str | None = None,
                 chat_template: str | None = None, stop_strings: Sequence[str] | None = None,
                 passes: str = "eager", max_cache_len: int | None = None,
                 prefix_cache: int = DEFAULT_PREFIX_CACHE) -> None:
        if model is None or tokenizer is None:
            raise InputError("A member needs both a model and a tokenizer.")
        if not hasattr(model, "config") or not callable(model):
            raise InputError(f"{type(model).__name__} is not a transformers causal LM (no config / not callable).")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        self.chat_template = chat_template
        has_template = bool(chat_template or getattr(tokenizer, "chat_template", None))
        self.stop_strings: tuple[str, ...] = tuple(stop_strings) if stop_strings is not None else (
            () if has_template else FALLBACK_STOPS)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids())
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        #: How this member's passes run: None (``passes="eager"``), or its static passes and slots
        #: (``"static"``, ``"graphs"``; :mod:`~ensemble_core.decoding.static`).
        self.static: StaticPasses | None = None
        if check_passes(passes) != "eager":
            self.static = StaticPasses(model, passes, max_cache_len)
        #: Its recent prompts' KV states, reused by requests that start the same way, eager caches and static
        #: slots alike (None: off; :mod:`~ensemble_core.decoding.prefix_cache`).
        self.prefix_cache: PrefixCache | None = PrefixCache(prefix_cache) if check_prefix_cache(prefix_cache) else None

    # ---------------------------------------------------------------- construction
    @classmethod
    def load(cls, source: str | MemberSpec, **options: Any) -> Member:
        """Load a member from an alias, a directory, a GGUF file or a hub id (cached per process)."""
        spec = member_spec(source if isinstance(source, MemberSpec) else str(source), options)
        model, tokenizer = load_objects(spec)
        name = spec.name or (str(spec.source) if spec.source in BUNDLED else Path(str(spec.source)).name or str(spec.source))
        return cls(model, tokenizer, name=name, chat_template=spec.chat_template, passes=spec.passes,
                   max_cache_len=spec.max_cache_len, prefix_cache=spec.prefix_cache)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---------------------------------------------------------------- properties
    @functools.cached_property
    def eos_id_tensor(self) -> torch.Tensor:
        """:attr:`eos_token_ids` as a sorted index tensor (to sum a distribution's end-of-text mass)."""
        return torch.tensor(sorted(self.eos_token_ids), dtype=torch.long)

    @property
    def device(self) -> torch.device:
        """Where input ids go (the first device under a device map)."""
        return self.model.device

    @property
    def context_window(self) -> int:
        cfg = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return int(getattr(self.tokenizer, "model_max_length", 2048))

    def __repr__(self) -> str:
        return f"Member({self.name!r}, device={self.device}, vocab={self.vocab_size})"

    # ---------------------------------------------------------------- text ↔ ids
    @property
    def native_tools(self) -> bool:
        """Whether this member's chat template renders tools itself (else they go into the system prompt)."""
        return template_supports_tools(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def messages(self, prompt: Prompt, structured: StructuredRequest | None = None,
                 normalized: bool = False) -> list[dict[str, Any]]:
        """The conversation as this member sees it (with tool / schema instructions).

        ``normalized``: ``prompt`` is already :func:`~ensemble_core.text.chat.normalize_messages`'
        output (a request normalises its prompt once for all members).
        """
        messages = prompt if normalized else normalize_messages(prompt)
        return with_instructions(messages, structured, self.native_tools) if structured and structured.active else messages

    def render(self, prompt: Prompt, structured: StructuredRequest | None = None) -> str:
        """The prompt as this member's own chat-formatted text, ending in the generation prompt."""
        return self.render_messages(self.messages(prompt, structured), structured)

    def render_messages(self, messages: list[dict[str, Any]], structured: StructuredRequest | None = None) -> str:
        """:meth:`render` of a conversation already as this member sees it (:meth:`messages`)."""
        return render_chat(self.tokenizer, messages, self.chat_template, tools=_template_tools(structured))

    def response_lead(self, prompt: Prompt, structured: StructuredRequest | None = None) -> str:
        """Whitespace this member's chat format puts before a reply (see :func:`~ensemble_core.text.chat.reply_lead`)."""
        return self.lead_of(self.messages(prompt, structured))

    def lead_of(self, messages: list[dict[str, Any]]) -> str:
        """:meth:`response_lead` of a conversation already as this member sees it (:meth:`messages`)."""
        return reply_lead(self.tokenizer, messages, self.chat_template)

    def prompt_ids(self, messages: list[dict[str, Any]], structured: StructuredRequest | None = None,
                   max_new_tokens: int = 0) -> list[int]:
        """Token ids of the rendered conversation (as this member sees it), checked against the context window."""
        ids = self.encode_messages(messages, structured)
        if len(ids) + max_new_tokens > self.context_window:
            raise PromptTooLongError(self.name, len(ids), max_new_tokens, self.context_window)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered prompt; BOS is added once, where the tokenizer wants it.

        Every special-token string in ``text`` becomes its control token: this is for text this
        member's chat template wrote. Messages go through :meth:`encode_messages`, which keeps the
        control-token strings inside their contents as text.
        """
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def encode_messages(self, messages: list[dict[str, Any]], structured: StructuredRequest | None = None) -> list[int]:
        """Token ids of a conversation as this member sees it (:meth:`messages`), rendered and encoded.

        The one place messages become ids (:meth:`prompt_ids`, so generation and the prefix cache;
        the adapters' token counting). Control tokens come only from the chat template: a
        special-token string of this member's tokenizer inside a message (``"<|im_end|>"`` in a
        user turn, a tool result, a retrieved document, a tool call's arguments, a tool's
        description) is encoded as text, as the tokenizer spells it with ``split_special_tokens=True``,
        so text from a third party cannot close its turn and open a system turn. Hosted chat APIs
        treat message content as text the same way; llama.cpp's tokenizer takes ``parse_special``
        for this, while ``apply_chat_template(tokenize=True)`` in transformers (and servers that
        tokenize its rendered string) read every such string in the prompt as a control token,
        which is what :meth:`encode_prompt` of the rendered prompt did here before.

        How: each special-token string in the messages is replaced by a private-use character
        (no special token contains it, and templates' filters such as ``trim`` keep it), the
        conversation is rendered, the characters are put back, and the text is encoded once as
        :meth:`encode_prompt` encodes it; the tokens that fall on a put-back string (one special
        token each, since the tokenizer splits there anyway) are replaced by that string's
        spelling as text. Template text and the content around it get the very ids they always
        got; a conversation without such strings is encoded exactly as :meth:`encode_prompt` of
        :meth:`render_messages` (golden outputs and prefix caches depend on it).
        """
        tools = _template_tools(structured)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        guard = _Guard(self._special_pattern, (messages, tools, template, self._special_strings)) \
            if self._special_pattern else None
        if guard is not None:
            messages, tools = guard.protect(messages), guard.protect(tools)
        text = render_chat(self.tokenizer, messages, self.chat_template, tools=tools)
        if guard is None or not guard.literals:
            return self.encode_prompt(text)
        text, spans = guard.restore(text)
        return self._encode_with_text_spans(text, spans)

    @functools.cached_property
    def _special_strings(self) -> tuple[str, ...]:
        """The strings this member's tokenizer reads as special tokens (longest first)."""
        tok = self.tokenizer
        found = {str(t) for t in getattr(tok, "all_special_tokens", ()) or ()}
        decoder = getattr(tok, "added_tokens_decoder", None) or {}
        found.update(str(getattr(t, "content", t)) for t in decoder.values() if getattr(t, "special", False))
        return tuple(sorted((s for s in found if s), key=len, reverse=True))

    @functools.cached_property
    def _special_pattern(self) -> regex.Pattern[str] | None:
        """Any of :attr:`_special_strings`, the longest where several match (a named list: Gemma-3 has 6249,
        as alternatives a pattern took 0.3 s on 120 KB of text)."""
        return regex.compile(r"\L<specials>", specials=self._special_strings) if self._special_strings else None

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        ids = self.tokenizer.convert_tokens_to_ids(list(self._special_strings))
        return frozenset(i for i in ids if isinstance(i, int))

    def _encode_with_text_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """:meth:`encode_prompt` of ``text``, with the special tokens over ``spans`` (content) spelled as text."""
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        add_special = not (bos and text.startswith(bos))

        try:
            enc = tok(text, add_special_tokens=add_special, return_offsets_mapping=True)
            offsets = enc["offset_mapping"]
        except (NotImplementedError, KeyError, TypeError, ValueError):  # a tokenizer without offsets
            return _encode_pieces(tok, text, spans, add_special)
        ids: list[int] = []
        k = 0
        for tid, (a, b) in zip(enc["input_ids"], offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            if b > a and tid in self._special_ids and k < len(spans) and spans[k][0] < b:
                ids += _as_text(tok, text[a:b])
            else:
                ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return alignment.decode(self.tokenizer, ids)

    def tokenize(self, text: str) -> alignment.Tokenized:
        return alignment.tokenize(self.tokenizer, text)

    def text_ids(self, text: str) -> list[int]:
        """``text`` as this member's token ids, no special tokens added (what usage and budgets count; the
        adapters' ``get_token_ids`` / ``token_ids``)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        return len(self.text_ids(text))

    # ---------------------------------------------------------------- decoding
    def start(self, prompt: Prompt, max_new_tokens: int = 0, structured: StructuredRequest | None = None) -> DecodeState:
        """A fresh decoding state for ``prompt`` (nothing is computed until :meth:`DecodeState.score`)."""
        return self.start_from_ids(self.prompt_ids(self.messages(prompt, structured), structured, max_new_tokens))

    def start_from_ids(self, ids: Sequence[int]) -> DecodeState:
        if len(ids) == 0:
            raise InputError(f"Member {self.name!r} needs at least one prompt token to start decoding.")
        return DecodeState(self, list(ids))


def _as_text(tokenizer: Any, piece: str) -> list[int]:
    """``piece`` as text: a special-token string spelled in ordinary tokens."""
    return list(tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _encode_pieces(tokenizer: Any, text: str, spans: list[tuple[int, int]], add_special: bool) -> list[int]:
    """:meth:`Member._encode_with_text_spans` for a tokenizer without offsets: the template's pieces as
    they are, the ``spans`` as text, one after another (the tokenizer splits at special tokens anyway)."""
    ids: list[int] = []
    at = 0
    for a, b in [*spans, (len(text), len(text))]:
        if text[at:a]:
            ids += tokenizer(text[at:a], add_special_tokens=add_special and at == 0)["input_ids"]
        ids += _as_text(tokenizer, text[a:b]) if b > a else []
        at = b
    return ids


def _template_tools(structured: StructuredRequest | None) -> list[dict[str, Any]] | None:
    """The tools a chat template is given (None: none, or ``tool_choice="none"``)."""
    tools = list(structured.tools) if structured and structured.tools and structured.choice != "none" else None
    return [{"type": "function", "function": t} for t in tools] if tools else None


#: Private-use characters that stand for special-token strings in messages while a template renders them.
_PLACEHOLDERS = range(0xE000, 0xF900)
_ESCAPED = re.compile(r"\\u([0-9a-fA-F]{4})")


class _Guard:
    """Special-token strings in messages swapped for private-use characters, and back (:meth:`Member.encode_messages`)."""

    def __init__(self, pattern: regex.Pattern[str], everything: Any) -> None:
        self.pattern = pattern
        self.everything = everything  # where a placeholder must not occur already (messages, tools, template)
        self.free: Iterator[str] | None = None
        self.literals: dict[str, str] = {}  # placeholder -> the special-token string it stands for
        self.marks: dict[str, str] = {}

    def _placeholders(self) -> Iterator[str]:
        """Private-use characters absent from the messages, tools and template, as themselves and as ``\\uXXXX``."""
        taken: set[int] = set()

        def visit(s: str) -> None:
            taken.update(ord(ch) for ch in s if _PLACEHOLDERS.start <= ord(ch) < _PLACEHOLDERS.stop)
            taken.update(int(h, 16) for h in _ESCAPED.findall(s))

        _strings(self.everything, visit)
        return (chr(c) for c in _PLACEHOLDERS if c not in taken)

    def _mark(self, match: regex.Match[str]) -> str:
        literal = match.group(0)
        if literal not in self.marks:
            if self.free is None:
                self.free = self._placeholders()
            mark = next(self.free, None)
            if mark is None:  # more distinct special strings than private-use characters
                raise InputError("The messages hold too many distinct special-token strings to encode them as text.")
            self.marks[literal], self.literals[mark] = mark, literal
        return self.marks[literal]

    def protect(self, value: Any, key: str | None = None) -> Any:
        if isinstance(value, str):
            return value if key == "role" else self.pattern.sub(self._mark, value)
        if isinstance(value, dict):
            return {k: self.protect(v, k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.protect(v) for v in value)
        return value

    def restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        """``text`` with the strings back, and where they are (a template's ``tojson(ensure_ascii=True)``
        writes a character as ``\\uXXXX``: that gives the string as JSON writes it)."""
        back = dict(self.literals)
        back.update({f"\\u{ord(mark):04x}": json.dumps(literal)[1:-1] for mark, literal in self.literals.items()})
        finder = re.compile("|".join(re.escape(k) for k in sorted(back, key=len, reverse=True)))
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        at = size = 0
        for match in finder.finditer(text):
            out.append(text[at:match.start()])
            size += match.start() - at
            literal = back[match.group(0)]
            out.append(literal)
            spans.append((size, size + len(literal)))
            size += len(literal)
            at = match.end()
        out.append(text[at:])
        return "".join(out), spans


def _strings(value: Any, visit: Callable[[str], Any]) -> None:
    if isinstance(value, str):
        visit(value)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, visit)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _strings(v, visit)


@dataclass
class DecodeStats:
    """Work done by one member for one request."""

    forward_passes: int = 0
    tokens_fed: int = 0
    seconds: float = 0.0
    reprefills: int = 0
    static_passes: int = 0  # passes run on the member's static slot (:mod:`~ensemble_core.decoding.static`)
    graph_replays: int = 0  # of those, replayed CUDA graphs
    prefix_reused: int = 0  # prompt tokens whose states came from the member's prefix cache (not fed)


#: The placeholder of an id appended on the device and not read yet (:meth:`DecodeState.score_steps`).
UNREAD = -1


class DecodeState:
    """One member's incremental decoding state: token ids and a KV cache over them.

    Invariant: ``cache`` holds the first ``cached`` ids; ``ids[cached:]`` are *pending*
    (appended, not yet run). ``_last_row`` holds the next-token logits after the last
    cached id, so a round that appends nothing needs no forward pass.
    """

    def __init__(self, member: Member, prompt_ids: list[int]) -> None:
        self.member = member
        self.ids: list[int] = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.stats = DecodeStats()
        static = self._static_cache()
        self.cache, self.cached = ((static, self._load_prefix(static)) if static is not None
                                   else self._fresh_cache(self.prompt_len - 1))
        self.stats.prefix_reused = self.cached
        #: whether the prompt's states are in the member's prefix cache (or need not be)
        self._prompt_stored = member.prefix_cache is None
        self._fed_since_crop = self.cached
        self._last_row: torch.Tensor | None = None
        #: the argmax of the last row of the last :meth:`score` with ``greedy``, when a batched pass read it
        self.chosen: int | None = None
        #: The batcher of the request that created this state (None: every pass runs alone);
        #: see :mod:`ensemble_core.decoding.scheduler`.
        self.batch: Binding | None = current()

    def _static_cache(self) -> StaticCache | None:
        """A cache on one of the member's static slots, counting into this state's stats (None: eager)."""
        static = self.member.static
        cache = static.new_cache(self.prompt_len) if static is not None else None
        if cache is not None:
            cache.stats = self.stats
        return cache

    def _fresh_cache(self, limit: int) -> tuple[Any, int]:
        """An eager cache for this state's ids and how many of them it holds: the longest prefix of the first
        ``limit`` ids that the member's prefix cache has, or none (an empty cache)."""
        store = self.member.prefix_cache
        restored = store.restore(self.member.model, self.ids, limit) if store is not None else None
        return restored if restored is not None else (new_cache(self.member.model), 0)

    def _load_prefix(self, static: StaticCache) -> int:
        """How many of this state's first ``prompt_len - 1`` ids the static slot now holds, loaded from the
        member's prefix cache (0: none stored)."""
        store = self.member.prefix_cache
        found = store.find(self.ids, self.prompt_len - 1, placement(self.member.model)) if store is not None else None
        if found is None:
            return 0
        n, entry = found
        static.load(entry.keys, entry.values, n)
        return n

    def _store_prompt(self) -> None:
        """Keep the prompt's states in the member's prefix cache, once a pass has computed them all."""
        if not self._prompt_stored and self.cached >= self.prompt_len:
            self._prompt_stored = True
            assert self.member.prefix_cache is not None
            self.member.prefix_cache.store(self.ids[:self.prompt_len], self.cache, placement(self.member.model))

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len:]

    def __len__(self) -> int:
        return len(self.ids)

    @torch.inference_mode()
    def score(self, new_ids: Sequence[int] = (), greedy: bool = False) -> torch.Tensor:
        """Append ``new_ids`` and return next-token logits, shape ``[len(new_ids) + 1, V]``.

        Row ``j`` is the distribution after ``ids_before + new_ids[:j]``: row 0 predicts
        the first new token, the last row predicts the token after all of them. Only the
        pending tail is run through the model (one forward pass). With ``greedy`` the caller
        will take the argmax of the last row: a batched pass reads it with the other requests'
        into :attr:`chosen` (None otherwise: the caller takes it).
        """
        self.chosen = None
        self.ids.extend(map(int, new_ids))
        pending = self.ids[self.cached:]
        want = len(new_ids) + 1
        if not pending:
            assert self._last_row is not None
            return self._last_row.unsqueeze(0)
        reuse_last = len(pending) < want  # nothing pending before new_ids: row 0 is cached
        last = self._last_row
        if reuse_last and last is None:
            raise InputError(f"Member {self.member.name!r} has no context to score from.")
        rows = self._run(pending, min(len(pending), want), greedy=greedy)
        if not reuse_last:
            return rows
        assert last is not None
        return torch.cat([last.to(rows.device).unsqueeze(0), rows], dim=0)

    @torch.inference_mode()
    def last_row(self, new_ids: Sequence[int] = ()) -> torch.Tensor:
        """``score(new_ids)[-1]``: the next-token logits after ``new_ids`` (``[V]``), the pass keeping its last
        position only (``score`` keeps a row per new id and puts the cached row before them: on a GPU a copy
        and a concatenation per step, only to be dropped, #38)."""
        self.chosen = None
        self.ids.extend(map(int, new_ids))
        pending = self.ids[self.cached:]
        if not pending:
            assert self._last_row is not None
            return self._last_row
        return self._run(pending, 1)[-1]

    @torch.inference_mode()
    def score_steps(self, n: int, choose: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` choices, each fed to the pass after it on the device, none read: the logits row each
        was chosen from (``[n, V]``, float) and the ids (``[n]``, on the device). A choice is the argmax of the
        raw logits, or ``choose(row)`` (a 0-d or 1-element id on the device: a sampled draw).
        The first ``n - 1`` are fed (:data:`UNREAD` in :attr:`ids` until :meth:`settle`), the last is not
        (the next round feeds it, or crops it). With nothing pending the first choice comes from
        the cached row, with no pass.

        One job of several steps (:attr:`~ensemble_core.decoding.forward.Job.steps`): alone, its passes run
        back to back; batched, the scheduler runs every such job's next step in one pass with the other
        requests' (vLLM's multi-step scheduling), so the request's thread waits once per ``n`` tokens, not
        once per token (#38; a loop that read each token before feeding it made the host wait for the device
        once per token). The same rows and ids as that loop.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"score_steps needs a number of steps >= 1, got {n!r}.")
        self.chosen = None
        pending = self.ids[self.cached:]
        first: list[torch.Tensor] = []  # the cached row and the id chosen from it, when nothing is pending
        unread = None
        if not pending:
            last = self._last_row
            if last is None:
                raise InputError(f"Member {self.member.name!r} has no context to score from.")
            unread = choice(last, choose)
            if n == 1:
                return last[None], unread
            first, n = [last, unread], n - 1
            self.ids.append(UNREAD)
            pending = [UNREAD]
        t0 = time.perf_counter()
        job = self._job(pending, 1, unread)
        job.steps, job.follow, job.choose = n, self.unread_job, choose
        rows = run_job(self.batch, self.member, job)
        ids = job.step_ids
        assert ids is not None, "a job of steps ends with its steps' ids or raises"
        self.ids.extend([UNREAD] * (n - 1))
        self.cached = len(self.ids)
        self._fed_since_crop += len(pending) + n - 1
        self._last_row = rows[-1]
        self.stats.forward_passes += n
        self.stats.tokens_fed += len(pending) + n - 1
        self.stats.seconds += time.perf_counter() - t0
        self._store_prompt()
        if first:
            return torch.cat([first[0][None], rows]), torch.cat([first[1], ids])
        return rows, ids

    def unread_job(self, token: torch.Tensor) -> Job:
        """The pass of one id the host has not read (``token``, on the device) on the cache, keeping its row:
        each next step of a job of several (:meth:`score_steps`, a segment's chunk on a branch)."""
        return self._job([UNREAD], 1, token.reshape(1))

    def _run(self, pending: list[int], keep: int, greedy: bool = False) -> torch.Tensor:
        """One forward pass of the ``pending`` ids (all of ``ids[cached:]``): its last ``keep`` rows; the
        state now caches every id and keeps the last row (and :attr:`chosen`), and the pass is counted."""
        t0 = time.perf_counter()
        job = self._job(pending, keep)
        job.greedy = greedy
        rows = run_job(self.batch, self.member, job)
        self.chosen = job.chosen
        self.cached = len(self.ids)
        self._fed_since_crop += len(pending)
        self._last_row = rows[-1]
        self.stats.forward_passes += 1
        self.stats.tokens_fed += len(pending)
        self.stats.seconds += time.perf_counter() - t0
        self._store_prompt()
        return rows

    def settle(self, start: int, ids: Sequence[int]) -> None:
        """The values of unread ids, read at last: ``ids`` are this state's ids from position ``start`` on."""
        if any(i != UNREAD for i in self.ids[start:start + len(ids)]):
            raise InputError(f"Member {self.member.name!r}: settle() only fills unread ids.")
        self.ids[start:start + len(ids)] = list(map(int, ids))

    def _job(self, pending: list[int], keep: int, unread: torch.Tensor | None = None) -> Job:
        """The forward pass of ``pending`` on this state's cache, keeping the last ``keep`` rows (``unread``: the
        ids on the device when ``pending`` holds placeholders). The member's device is asked only by the model's
        own call (a static or batched pass never needs it: ~7 us per pass, transformers' ``model.device``
        walks the modules for a parameter)."""
        member, cache = self.member, self.cache

        def direct() -> torch.Tensor:
            return single_pass(member.model, unread if unread is not None else pending, cache, keep, member.device)

        job = causal_job(cache, pending, range(len(pending) - keep, len(pending)), direct)
        job.device_ids = unread
        return route(job)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` ids (``1 <= n <= len``), dropping the rest and their cache.

        Id ``n - 1`` becomes pending again when it was cached, so that the next
        :meth:`score` recomputes the distribution after exactly ``n`` ids.
        """
        if n < 1 or n > len(self.ids):
            raise InputError(f"Cannot crop member {self.member.name!r} to {n} tokens (has {len(self.ids)}).")
        del self.ids[n:]
        if self.cached < n:  # only pending ids were dropped
            return
        if self.cached == n:  # nothing to drop; trim sliding layers back to their window
            if self._fed_since_crop:
                crop(self.cache, 0)
            self._fed_since_crop = 0
            return
        remove = self.cached - (n - 1)
        if can_crop_exactly(self.cache, remove, self._fed_since_crop):
            crop(self.cache, remove)
            self.cached, self._fed_since_crop = n - 1, 0
        else:  # sliding window already dropped the states we need: rebuild (from the stored prompt, if kept)
            self.cache, self.cached = self._fresh_cache(n - 1)
            self._fed_since_crop = self.cached
            self.stats.reprefills += 1
        self._last_row = None

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append ids without running the model (they are fed on the next :meth:`score`)."""
        self.ids.extend(map(int, new_ids))
