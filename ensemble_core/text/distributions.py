"""Ensemble distributions: fusing next-token distributions over different vocabularies.

Members with different tokenizers cannot average probability vectors index by index.
Both rules here compare tokens by their *text*, as UTF-8 bytes (a byte-level BPE token
and a SentencePiece byte-fallback token for the same byte are the same key), and return
a small set of :class:`Candidates`: complete strings (or the end of the text) with each
member's probability and the average.

* :class:`UniTE` (top-k union, ICLR 2025): each member's top-k strings are united; a
  member's probability of a string outside its own top-k is the probability of the token
  with exactly that text when it has one, else of the first token of its own encoding of
  the string. The published rule (``sub_tokens="shared"``) gives that first token's
  probability, whole, to every such string as well as to the token itself, so a longer
  string the member never meant ties with its own token; ``"once"`` (the library's default)
  counts each of a member's tokens for one candidate only. Probabilities are
  full-vocabulary (no re-normalisation over the union), so over identical tokenizers the
  fused value is the plain average.
* :class:`GaC` (union vocabulary, EMNLP Findings 2024): every member's whole vocabulary is
  mapped once onto the union of normalised token texts (``Ġ``/``▁`` → space, ``Ċ`` →
  newline, ``<0xNN>`` → that byte); a member's union distribution is a scatter-add of its
  probabilities (a sparse matmul with a 0/1 matrix, done as ``index_add``), the fused one
  the average.

Both rules do their vocabulary work where the members' probabilities are and bring back only the
few values a step needs, in one read (#38: on a GPU each read waits for the device): GaC its top
candidates' entries, UniTE each member's top-k ids together with every member's probability of
every candidate, gathered through a :class:`BackingTable` per member (which learns a string's first
sub-token the first time it is a candidate: that step reads twice).

Only *complete* strings are candidates: a token that stops inside a multi-byte character
(SmolLM2's first byte of "東") cannot be appended as text. Its mass still counts where a
complete string of another member starts with it (UniTE's first-token lookup). The chosen
string is always appended whole, never just its first sub-token (a pitfall of the
published UniTE code).

Sharpening (:func:`sharpen`) counters the way averaging over different tokenizations
spreads mass over "So" / "Sof" / "Sofia": the SAFE paper's prefix merge, or a geometric
mean that penalises strings one member finds unlikely.

Both papers average the members uniformly, and so does this module by default. With
members of unequal strength that is a trap: two weak members that agree outvote a strong
one (measured: the trio SmolLM2 + Gemma-3 + Qwen2.5 loses arith questions Qwen alone gets
right, docs/benchmarks.md). ``fusion_weights`` (:func:`fusion_weights`) turn the average
into a weighted one, the geometric mean likewise.
"""

from __future__ import annotations

import gc
import re
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar, Union

import torch

from ensemble_core.errors import ConstraintError, InvalidOptionError
from ensemble_core.options import (
    FUSION_RULES,
    SHARPENINGS,
    SUB_TOKEN_RULES,
    WEIGHTS_EXPECTED,
    check_choice,
    check_int,
    normalize_weight_option,
)
from ensemble_core.transfer import read_together, to_device


class EndOfText:
    """The candidate "stop here" (any of a member's EOS tokens)."""

    _instance: EndOfText | None = None

    def __new__(cls) -> EndOfText:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<end of text>"


END = EndOfText()
#: A candidate: the UTF-8 bytes of a string, or :data:`END`.
Key = Union[bytes, EndOfText]

#: Sharpening applies only when the fused distribution's maximum is below this.
SHARPEN_BELOW = 0.5
#: Prefix merge only lifts candidates with more fused mass than this (published value).
PREFIX_MIN_PROB = 0.1


# ============================================================================ token texts
@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable stand-in character → byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(tokenizer: Any) -> set[str]:
    """Types of the fast tokenizer's decoder pipeline (``ByteLevel``, ``ByteFallback``, ...)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    return set(re.findall(r"([A-Za-z]+)\(", repr(decoder)))  # "Sequence(decoders=[Replace(...), ByteFallback(), ...])"


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes | None]:
    """The UTF-8 bytes each token contributes to a text (None: special or unknown id).

    Byte-level BPE tokens are mapped back through GPT-2's byte alphabet; SentencePiece
    pieces get ``▁`` → space and ``<0xNN>`` → that byte. Other tokenizers fall back to
    decoding each id alone (a token that decodes to U+FFFD then has no key).
    """
    ids = [int(i) for i in ids]
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", False))
    kinds = _decoder_types(tokenizer)
    known = [i for i in ids if 0 <= i < size and i not in special]
    out: dict[int, bytes | None] = {}
    if "ByteLevel" in kinds:
        table = _byte_decoder()
        for i, piece in zip(known, tokenizer.convert_ids_to_tokens(known)):
            try:
                out[i] = bytes(table[c] for c in piece)
            except KeyError:  # an added (non-special) token written in plain text
                out[i] = piece.encode("utf-8")
    elif "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        for i, piece in zip(known, tokenizer.convert_ids_to_tokens(known)):
            match = _BYTE_TOKEN.match(piece)
            out[i] = bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")
    else:
        texts = [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in known]
        for i, text in zip(known, texts):
            out[i] = None if "\ufffd" in text else text.encode("utf-8")
    return [out.get(i) or None for i in ids]


def is_complete(key: bytes) -> bool:
    """Whether ``key`` is whole UTF-8 text (no character cut in two)."""
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class TokenTable:
    """One member's vocabulary as texts: key per id, ids per key, which ids are candidates.

    ``size`` is the number of rows of the model's output (it may exceed the tokenizer's
    vocabulary; the extra ids have no text).
    """

    keys: tuple[bytes | None, ...]
    ids_of: dict[bytes, tuple[int, ...]]
    eos_ids: tuple[int, ...]
    selectable: torch.Tensor  # bool [size]: complete, non-empty text, or EOS

    @property
    def size(self) -> int:
        return len(self.keys)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Building ~10^5 small objects would trigger collections that rescan the (large) heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_TABLES: dict[tuple[int, int, tuple[int, ...]], tuple[Any, TokenTable]] = {}
_TABLE_LOCK = threading.Lock()
#: one lock per table being built: concurrent first requests wait for one build instead of each making it
_BUILD_LOCKS: dict[tuple[int, int, tuple[int, ...]], threading.Lock] = {}


def token_table(tokenizer: Any, size: int, eos_ids: Sequence[int]) -> TokenTable:
    """The :class:`TokenTable` of a tokenizer (built once per process: ~0.3 s for 262k tokens).

    Built by one thread only: eight concurrent first requests of a batched SAFE run each
    built Gemma-3's and SmolLM2's tables at once under the GIL, ~8 s of a 30-40 s batch
    (py-spy, ``docs/benchmarks.md``).
    """
    eos = tuple(sorted(int(i) for i in eos_ids if 0 <= int(i) < size))
    cache_key = (id(tokenizer), size, eos)
    with _TABLE_LOCK:
        hit = _TABLES.get(cache_key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        build_lock = _BUILD_LOCKS.setdefault(cache_key, threading.Lock())
    with build_lock:
        with _TABLE_LOCK:
            hit = _TABLES.get(cache_key)
            if hit is not None and hit[0] is tokenizer:
                return hit[1]
        table = _build_table(tokenizer, size, eos)
        with _TABLE_LOCK:
            _TABLES[cache_key] = (tokenizer, table)  # the tokenizer is kept so its id is not reused
            _BUILD_LOCKS.pop(cache_key, None)
    return table


def _build_table(tokenizer: Any, size: int, eos: tuple[int, ...]) -> TokenTable:
    with _gc_paused():
        keys = token_bytes(tokenizer, range(size))
        for i in eos:
            keys[i] = None
        ids_of: dict[bytes, tuple[int, ...]] = {}
        for i, k in enumerate(keys):
            if k is not None:
                ids_of[k] = ids_of.get(k, ()) + (i,)
        ok = [i for i, k in enumerate(keys) if k is not None and is_complete(k)]
    selectable = torch.zeros(size, dtype=torch.bool)
    selectable[torch.tensor(ok, dtype=torch.long)] = True
    if eos:
        selectable[list(eos)] = True
    return TokenTable(tuple(keys), ids_of, eos, selectable)


def member_table(member: Any) -> TokenTable:
    """:func:`token_table` for anything with ``tokenizer``, ``vocab_size`` and ``eos_token_ids``."""
    return token_table(member.tokenizer, int(member.vocab_size), sorted(member.eos_token_ids))


def prepare_fusion(members: Sequence[Any], union: bool = True) -> None:
    """Build what fusing ``members`` needs, once per process: each member's :class:`TokenTable` (lazy tool
    grammars use it too) and, with ``union``, their :class:`UnionVocabulary` and each member's
    :class:`BackingTable` (~1.4 s for the three bundled tokenizers on two cores; a server's first request
    paid it mid-answer)."""
    tables = [member_table(m) for m in members]
    if union and len(tables) > 1:
        vocabulary = union_vocabulary(tables)
        for m, table in enumerate(tables):
            backing_table(vocabulary, m, table)


# ============================================================================ candidates
@dataclass(frozen=True)
class Candidates:
    """A fused distribution over a small set of candidate continuations.

    ``member_probs[m, c]`` is member ``m``'s probability of candidate ``c``; ``fused`` their
    average (weighted by ``weights`` when given); ``drafter_top[c]`` whether ``c`` is among the drafter's own top-k (the prefix
    merge lifts only those). Earlier candidates win ties (the drafter's come first). ``exclusive``: each of a
    member's tokens backs one candidate at most (UniTE's ``sub_tokens="once"``), so a member's
    probabilities of different candidates are disjoint events.
    """

    keys: tuple[Key, ...]
    member_probs: torch.Tensor
    fused: torch.Tensor
    drafter_top: torch.Tensor
    weights: torch.Tensor | None = None  # per member, summing to 1; None: uniform
    exclusive: bool = False

    def __len__(self) -> int:
        return len(self.keys)

    def text(self, index: int) -> str | None:
        """The text of candidate ``index`` (None for the end of the text)."""
        key = self.keys[index]
        return None if isinstance(key, EndOfText) else key.decode("utf-8")

    def subset(self, keep: Sequence[bool]) -> Candidates | None:
        """Only the candidates where ``keep`` is true (None if none is): a grammar's choice."""
        idx = [i for i, k in enumerate(keep) if k]
        if not idx:
            return None
        at = torch.tensor(idx, dtype=torch.long)
        return Candidates(tuple(self.keys[i] for i in idx), self.member_probs[:, at], self.fused[at],
                          self.drafter_top[at], self.weights, self.exclusive)

    def merged(self, group: Sequence[int]) -> Candidates:
        """The candidates of ``group`` taken as one decision spelled several ways (a tool call opened as
        ``<tool_call>``, ``{"`` or ``{`` and a newline): each member's probability of the decision is the
        sum over the spellings (different first tokens are disjoint events; unless the candidates are
        ``exclusive``, a spelling that is a prefix of another in the group is left out, since the longer
        one may carry the same token's probability, so that no mass counts twice), carried by the spelling the
        members favour most; the other spellings drop out. Why: without it the votes for one decision
        split over its spellings and a second choice outvotes it (measured: Qwen2.5-Coder gave a call
        0.34 over two spellings and "The" 0.20; the fused 0.20 / 0.06 lost to "The" at 0.22).
        """
        if len(group) < 2:
            return self
        at = torch.tensor(list(group), dtype=torch.long)
        lead = int(at[int(self.fused[at].argmax())])
        member_probs = self.member_probs.clone()
        texts = {i: self.keys[i] for i in group}
        maximal = list(texts) if self.exclusive else [
            i for i, t in texts.items()
            if not any(j != i and isinstance(o, bytes) and isinstance(t, bytes) and o.startswith(t)
                       for j, o in texts.items())]
        member_probs[:, lead] = self.member_probs[:, maximal].sum(dim=1).clamp(max=1.0)
        weights = self.weights if self.weights is not None else torch.full(
            (member_probs.shape[0],), 1.0 / member_probs.shape[0])
        fused = self.fused.clone()
        fused[lead] = (weights.to(member_probs.dtype) * member_probs[:, lead]).sum()
        drop = set(group) - {lead}
        keep = torch.tensor([i for i in range(len(self.keys)) if i not in drop], dtype=torch.long)
        return Candidates(tuple(self.keys[i] for i in keep.tolist()), member_probs[:, keep], fused[keep],
                          self.drafter_top[keep], self.weights, self.exclusive)

    def reweighted(self, factors: torch.Tensor) -> Candidates:
        """The same candidates with ``fused`` scaled by ``factors`` (a penalty on some of them).

        Not renormalized: a penalized candidate's mass is gone, as a masked token's is, so
        :func:`sharpen` sees how sure the members still are about the rest.
        """
        return Candidates(self.keys, self.member_probs, self.fused * factors.to(self.fused.dtype), self.drafter_top,
                          self.weights, self.exclusive)


def grammar_allows(grammar: Any, prefix: str, key: Key) -> bool:
    """Whether ``grammar`` (a ``constraints.ConstraintState`` at the committed text) accepts ``prefix`` then ``key``.

    A candidate that is no whole character, or that this member's tokenizer cannot spell (a control
    byte only another member's vocabulary holds: Gemma-3 has ``'\x14'``, SmolLM2 cannot write it), is
    not one the member's grammar can follow: not allowed, rather than the spelling error that stopped
    a SAFE request under ``json_object`` mid-answer. (The committed text itself is always spelled: an
    error there is raised where it is committed.)
    """
    if isinstance(key, EndOfText):
        return grammar.accepts_text(prefix, end=True)
    try:
        return grammar.accepts_text(prefix + key.decode("utf-8"))
    except (UnicodeDecodeError, ConstraintError):
        return False


class Distribution(ABC):
    """A fusion rule over the members' next-token distributions (one subclass per rule).

    ``members``: objects with ``tokenizer``, ``vocab_size`` and ``eos_token_ids`` (the
    :class:`~ensemble_core.decoding.members.Member` API). :meth:`fuse` takes one probability vector
    per member, in member order, and the index of the drafter.

    ``prefixes[m]`` (optional) is text that member ``m`` still has to write before the
    shared text continues: at the very start of a reply a base-model transcript member
    (``"Assistant:"``) writes ``" The"`` where a chat member writes ``"The"``. Member
    ``m``'s candidate ``prefix + s`` then counts as ``s``; strings not starting with the
    prefix are not candidates for it.
    """

    name: ClassVar[str] = "distribution"
    #: How a member scores a string that is not one of its tokens (UniTE's ``"shared"`` / ``"once"``; ""
    #: for rules without that choice); the stats report it.
    sub_tokens: str = ""

    def __init__(self, members: Sequence[Any], top_k: int = 10) -> None:
        check_int("top_k", top_k, 1)
        self.members = list(members)
        self.top_k = top_k
        self._tables: list[TokenTable] | None = None
        self._union: UnionVocabulary | None = None

    @property
    def tables(self) -> list[TokenTable]:
        if self._tables is None:
            self._tables = [member_table(m) for m in self.members]
        return self._tables

    @property
    def union(self) -> UnionVocabulary:
        """The members' :class:`UnionVocabulary` (built on first use, shared by every rule over these members)."""
        if self._union is None:
            self._union = union_vocabulary(self.tables)
        return self._union

    def _check(self, probs: Sequence[torch.Tensor], drafter: int, prefixes: Sequence[bytes] | None,
               weights: torch.Tensor | None = None) -> tuple[list[torch.Tensor], list[bytes]]:
        """The members' vectors checked and flattened (float32), left where they are: a rule reads only the
        few entries it needs (#38; a copy of GaC's inputs to the host here moved every member's whole
        vocabulary per token, unused)."""
        n = len(self.members)
        if len(probs) != n:
            raise InvalidOptionError("probs", f"{len(probs)} vectors", f"one per member ({n})")
        if not 0 <= drafter < n:
            raise InvalidOptionError("drafter", drafter, f"a member index in 0..{n - 1}")
        if prefixes is not None and (len(prefixes) != n or not all(isinstance(x, bytes) for x in prefixes)):
            raise InvalidOptionError("prefixes", prefixes, f"one bytes string per member ({n})")
        if weights is not None and tuple(weights.shape) != (n,):
            raise InvalidOptionError("weights", tuple(weights.shape), f"one weight per member ({n}): see fusion_weights()")
        out = []
        for p, table in zip(probs, self.tables):
            p = p.detach().float().reshape(-1)
            if p.numel() != table.size:
                raise InvalidOptionError("probs", f"a vector of {p.numel()}",
                                         f"{table.size} probabilities (the member's vocabulary)")
            out.append(p)
        return out, list(prefixes) if prefixes is not None else [b""] * n

    @staticmethod
    def _top_ids(rows: Sequence[torch.Tensor], selectable: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
        """Each row's ``sizes[i]`` most likely ids among ``selectable[i]``, found where the row lives (not read)."""
        picks = []
        for p, allowed, k in zip(rows, selectable, sizes):
            barred, count = _selectable_on(allowed, p.device)
            picks.append(torch.topk(p.masked_fill(barred, -1.0), min(k, count)).indices)
        return picks

    @classmethod
    def _tops(cls, rows: Sequence[torch.Tensor], selectable: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[list[int]]:
        """:meth:`_top_ids` read together: one host read per device, not one per member (#38)."""
        return read_together(cls._top_ids(rows, selectable, sizes))

    @abstractmethod
    def fuse(self, probs: Sequence[torch.Tensor], drafter: int = 0,
             prefixes: Sequence[bytes] | None = None, weights: torch.Tensor | None = None) -> Candidates:
        """Fuse one probability vector per member into :class:`Candidates`.

        ``weights``: one non-negative weight per member summing to 1 (:func:`fusion_weights`);
        None averages uniformly, as the papers do.
        """


#: Per selectable mask (by id, checked against a weak reference): its count and its copies per device.
_SELECTABLE: dict[int, tuple[weakref.ref[torch.Tensor], int, dict[str, torch.Tensor]]] = {}
_SELECTABLE_LOCK = threading.Lock()


def _selectable_on(selectable: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """A table's ids that are *not* selectable, as a mask on ``device``, and how many ids it selects, both kept
    per table: the count is read once, not per token, and the mask inverted and copied once per device (a
    top-k runs where the member's probabilities are, so that only the chosen ids come back to the host; an
    inversion per member and token was one more kernel to launch)."""
    with _SELECTABLE_LOCK:
        entry = _SELECTABLE.get(id(selectable))
        if entry is None or entry[0]() is not selectable:
            entry = _SELECTABLE[id(selectable)] = (weakref.ref(selectable), int(selectable.sum()), {})
        _, count, copies = entry
        barred = copies.get(str(device))
        if barred is None:
            barred = copies[str(device)] = to_device(~selectable, device)
    return barred, count


def _strip_prefix(key: Key, prefix: bytes) -> Key | None:
    """The shared-text candidate for a member's ``key`` after its ``prefix`` (None: not one)."""
    if not prefix or isinstance(key, EndOfText):
        return key
    if not key.startswith(prefix) or len(key) == len(prefix):
        return None
    rest = key[len(prefix):]
    return rest if is_complete(rest) else None


def _gather_candidates(tops: Sequence[Sequence[Key]], order: Sequence[int],
                       drafter: int) -> tuple[list[Key], torch.Tensor]:
    """Unite per-member candidate lists (drafter first); mark the drafter's own."""
    keys: list[Key] = list(dict.fromkeys(k for m in order for k in tops[m]))
    own = set(tops[drafter])
    return keys, torch.tensor([k in own for k in keys], dtype=torch.bool)


class UniTE(Distribution):
    """Top-k union: candidates are the members' top-k strings (see the module docstring).

    ``sub_tokens``: ``"shared"`` (published) or ``"once"``, how a member scores a string that is not one
    of its tokens (:func:`one_candidate_per_token`; ``ensemble_core.options.sub_token_rule`` says why).
    """

    name = "unite"

    def __init__(self, members: Sequence[Any], top_k: int = 10, sub_tokens: str = "shared") -> None:
        super().__init__(members, top_k)
        self.sub_tokens = check_choice("sub_tokens", sub_tokens, SUB_TOKEN_RULES)

    def fuse(self, probs: Sequence[torch.Tensor], drafter: int = 0,
             prefixes: Sequence[bytes] | None = None, weights: torch.Tensor | None = None) -> Candidates:
        probs, prefixes = self._check(probs, drafter, prefixes, weights)  # only top-k entries are read
        if any(prefixes) or len({p.device for p in probs}) > 1:
            return self._fuse_by_text(probs, drafter, prefixes, weights)
        return self._fuse_on_device(probs, drafter, weights)

    def _fuse_on_device(self, probs: Sequence[torch.Tensor], drafter: int, weights: torch.Tensor | None) -> Candidates:
        """The fusion in one read (#38): where the members' probabilities are, each member's top-k is found,
        mapped onto the union vocabulary, and every member's probability of each of those strings gathered
        through its :class:`BackingTable`; the ids and probabilities then come back together. A string whose
        first sub-token a member has not been asked for yet costs a second read, once per member and string
        (:meth:`_learn`). Equal to :meth:`_fuse_by_text` (``tests/test_distributions.py`` holds it)."""
        tables, union, n = self.tables, self.union, len(probs)
        maps = union.maps_on(probs[0].device)
        backings = [backing_table(union, m, table) for m, table in enumerate(tables)]
        seen = [b.fills for b in backings]  # what the tables held when the gathers below were queued
        picks = self._top_ids(probs, [t.selectable for t in tables], [self.top_k] * n)
        at = torch.cat([maps[m][ids] for m, ids in enumerate(picks)])
        union_at, values = read_together([at, gather_backed(backings, probs, at)])  # the one read
        where: dict[Key, int] = {}  # a candidate's column in ``at`` (any column holding it: same string, same values)
        tops: list[list[Key]] = []
        offset = 0
        for ids in picks:  # a member's top ids are its selectable tokens: each is the union string it maps to
            own = [union.key(u) for u in union_at[offset:offset + len(ids)]]
            for j, key in enumerate(own):
                where.setdefault(key, offset + j)
            tops.append(own)
            offset += len(own)
        order = [drafter] + [m for m in range(n) if m != drafter]
        keys, drafter_top = _gather_candidates(tops, order, drafter)
        places = [union_at[where[key]] for key in keys]  # the candidates' union indices
        learned = self._learn(keys, places, backings, seen, probs)
        width, once = len(union_at), self.sub_tokens == "once"
        member_probs = torch.tensor([_backed(backing, keys, places, [values[m * width + where[key]] for key in keys],
                                             learned[m], once) for m, backing in enumerate(backings)], dtype=torch.float32)
        return Candidates(tuple(keys), member_probs, weighted_mean(member_probs, weights), drafter_top, weights, once)

    def _learn(self, keys: Sequence[Key], places: Sequence[int], backings: Sequence[BackingTable], seen: Sequence[int],
               probs: Sequence[torch.Tensor]) -> list[dict[int, float]]:
        """Per member, the probabilities of the candidates whose backing its table did not hold when the
        gathers were queued (``{candidate: probability}``), read together; the first sub-tokens found are
        written into the tables, so that the next time the string is a candidate it is gathered with the rest."""
        asks: list[list[tuple[int, int]]] = []  # per member: (candidate, first sub-token id)
        for backing, member, count in zip(backings, self.members, seen):
            unknown = [(c, u) for c, u in enumerate(places) if not backing.known(u, count)]
            fresh = [(c, u) for c, u in unknown if not backing.learned(u)]
            if fresh:
                texts = [keys[c].decode("utf-8") for c, _ in fresh]  # type: ignore[union-attr]
                encoded = member.tokenizer(texts, add_special_tokens=False)["input_ids"]
                backing.learn([(u, int(e[0]) if e and 0 <= e[0] < backing.size else None) for (_, u), e in zip(fresh, encoded)])
            asks.append([(c, first) for c, u in unknown if (first := backing.first(u)) is not None])
        got = read_together([p[to_device([f for _, f in ask], p.device)] for p, ask in zip(probs, asks)]) if any(asks) else []
        return [dict(zip((c for c, _ in ask), values)) for ask, values in zip(asks, got)] if got else [{} for _ in asks]

    def _fuse_by_text(self, probs: Sequence[torch.Tensor], drafter: int, prefixes: Sequence[bytes],
                      weights: torch.Tensor | None) -> Candidates:
        """The fusion with candidates matched as text, in two reads (top-k ids, then the probabilities of
        the tokens backing the candidates): for a reply's start, where a member's candidates carry a prefix,
        and for members on different devices."""
        tables = self.tables
        order = [drafter] + [m for m in range(len(probs)) if m != drafter]
        tops: list[list[Key]] = []
        for ids, table, prefix in zip(self._tops(probs, [t.selectable for t in tables], [self.top_k] * len(probs)),
                                      tables, prefixes):
            stripped = (_strip_prefix(END if i in table.eos_ids else table.keys[i], prefix) for i in ids)  # type: ignore[arg-type]
            tops.append([key for key in stripped if key is not None])
        keys, drafter_top = _gather_candidates(tops, order, drafter)
        once = self.sub_tokens == "once"
        backing = [self._backing(keys, table, member, prefix, once)
                   for table, member, prefix in zip(tables, self.members, prefixes)]
        # each member's entries gathered where its probabilities are, all read together (#38)
        values = read_together([p[to_device(ids, p.device)] for p, (ids, _) in zip(probs, backing)])
        member_probs = torch.zeros(len(probs), len(keys))
        for row, (ids, slots), got in zip(member_probs, backing, values):
            if ids:
                row.index_add_(0, torch.tensor(slots, dtype=torch.long), torch.tensor(got, dtype=torch.float32))
        return Candidates(tuple(keys), member_probs, weighted_mean(member_probs, weights), drafter_top, weights, once)

    @staticmethod
    def _backing(keys: Sequence[Key], table: TokenTable, member: Any, prefix: bytes = b"",
                 once: bool = False) -> tuple[list[int], list[int]]:
        """Which of a member's tokens back which candidate (``ids[i]`` backs candidate ``slots[i]``; a
        candidate's probability is the sum over its tokens): its tokens with exactly that text, else the
        first sub-token of its encoding (with ``once``, a first sub-token that already backs a candidate,
        or a shorter one, backs no other)."""
        ids: list[int] = []
        slots: list[int] = []
        missing: list[tuple[int, bytes]] = []
        for c, key in enumerate(keys):
            own = table.eos_ids if isinstance(key, EndOfText) else table.ids_of.get(prefix + key, ())
            if own:
                ids.extend(own)
                slots.extend([c] * len(own))
            elif isinstance(key, bytes):
                missing.append((c, prefix + key))
        if missing:
            texts = [key.decode("utf-8") for _, key in missing]
            encoded = member.tokenizer(texts, add_special_tokens=False)["input_ids"]
            found = [((c, int(first[0])), len(key)) for (c, key), first in zip(missing, encoded)
                     if first and 0 <= first[0] < table.size]
            firsts = [pair for pair, _ in found]
            if once:  # lengths of the strings that have a first sub-token (were of every missing string: misaligned)
                firsts = one_candidate_per_token(firsts, set(ids), [length for _, length in found])
            for c, first in firsts:
                ids.append(first)
                slots.append(c)
        return ids, slots


def _backed(backing: BackingTable, keys: Sequence[Key], places: Sequence[int], gathered: Sequence[float],
            learned: dict[int, float], once: bool) -> list[float]:
    """One member's probability of each candidate (``places``: their union indices; ``gathered``: the values
    its :class:`BackingTable` gathered; ``learned``: the values read for candidates it did not hold yet): a
    candidate that is one of its tokens counts them, any other its first sub-token, which with ``once`` backs
    one candidate at most (:func:`one_candidate_per_token`), as :meth:`UniTE._backing` rules on the host."""
    exact = [backing.exact(u) for u in places]
    firsts = [(c, first) for c, u in enumerate(places) if not exact[c] and (first := backing.first(u)) is not None]
    if once:
        taken = {i for u, ok in zip(places, exact) if ok for i in backing.ids(u)}
        firsts = one_candidate_per_token(firsts, taken, [len(keys[c]) for c, _ in firsts])  # type: ignore[arg-type]
    backed = {c for c, _ in firsts}
    return [learned.get(c, value) if exact[c] or c in backed else 0.0 for c, value in enumerate(gathered)]


def one_candidate_per_token(firsts: Sequence[tuple[int, int]], taken: set[int],
                            lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Of ``(candidate, first token id)`` pairs (a member's first sub-token of each candidate string that
    is not one of its tokens, ``lengths[i]`` the byte length of pair ``i``'s string), the pairs that keep
    the token's probability: none whose token already backs a candidate as its exact text (in ``taken``),
    and of those sharing a token the shortest string (the earliest on a tie).

    Why: the token's probability is the member's belief in that token followed by anything; the exact
    token, or else the string closest to it, is what the member means, and a longer string that merely
    starts with it must not tie with it (the published UniTE pitfall, ``ensemble_core.options.sub_token_rule``).
    """
    best: dict[int, int] = {}
    for i, (_, token) in enumerate(firsts):
        if token not in taken and (token not in best or lengths[i] < lengths[best[token]]):
            best[token] = i
    return [firsts[i] for i in sorted(best.values())]


@dataclass(frozen=True)
class UnionVocabulary:
    """The union of several vocabularies' texts: ``maps[m][id]`` = union index of member m's token.

    Index ``len(keys)`` is the end of the text; ``len(keys) + 1`` collects ids without a
    text (specials), which are never candidates.
    """

    keys: tuple[bytes, ...]
    index: dict[bytes, int]
    maps: tuple[torch.Tensor, ...]
    selectable: torch.Tensor  # bool [len(keys) + 2]
    _copies: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict, compare=False, repr=False)

    def maps_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """:attr:`maps` on ``device``, copied once per device (the union projection runs where the probabilities are)."""
        key = str(device)
        with _TABLE_LOCK:
            maps = self._copies.get(key)
            if maps is None:
                maps = self._copies[key] = tuple(to_device(m, device) for m in self.maps)
        return maps

    @property
    def end(self) -> int:
        return len(self.keys)

    def key(self, index: int) -> Key:
        return END if index == self.end else self.keys[index]

    def position(self, key: Key) -> int | None:
        return self.end if isinstance(key, EndOfText) else self.index.get(key)


_UNIONS: dict[tuple[int, ...], tuple[tuple[TokenTable, ...], UnionVocabulary]] = {}


def union_vocabulary(tables: Sequence[TokenTable]) -> UnionVocabulary:
    """The :class:`UnionVocabulary` of some token tables (built once per member set and cached)."""
    cache_key = tuple(id(t) for t in tables)
    with _TABLE_LOCK:
        hit = _UNIONS.get(cache_key)
        if hit is not None and all(a is b for a, b in zip(hit[0], tables)):
            return hit[1]
    with _gc_paused():
        index: dict[bytes, int] = {}
        for table in tables:
            for key in table.ids_of:
                index.setdefault(key, len(index))
        end, dump = len(index), len(index) + 1
        maps = []
        for table in tables:
            m = [index[k] if k is not None else dump for k in table.keys]
            for i in table.eos_ids:
                m[i] = end
            maps.append(torch.tensor(m, dtype=torch.long))
        keys = tuple(index)
        selectable = torch.tensor([is_complete(k) for k in keys] + [True, False], dtype=torch.bool)
    union = UnionVocabulary(keys, index, tuple(maps), selectable)
    with _TABLE_LOCK:
        _UNIONS[cache_key] = (tuple(tables), union)
    return union


class BackingTable:
    """Which of one member's tokens back each string of a union vocabulary, kept where the probabilities are.

    Why (#38): UniTE matches candidates as text, so finding a member's probability of another member's
    string took a host read of the top-k ids, a tokenizer call and a second read. With this table a
    member's probability of any union string is a gather on the device, in the same read as the top-k.

    Row ``u`` holds the member's ids whose text is union string ``u`` (its EOS ids for the end of the
    text), padded with -1. A string that is not one of the member's tokens is backed by the first token
    of the member's encoding of it (UniTE's rule): that needs the tokenizer, and encoding all of a
    union's 10^5 strings up front costs 2-6 s per member on two cores, so it is filled in the first time
    the string is a candidate (:meth:`learn`); each fill is numbered, and a gather queued when the table
    had ``seen`` fills holds the entries numbered up to ``seen`` (:meth:`known`), whatever other threads
    add meanwhile.
    """

    def __init__(self, union: UnionVocabulary, member: int, table: TokenTable) -> None:
        self.size = table.size
        self._table = table
        self._end = union.end
        self._keys = union.keys
        sizes = [len(m) for m in union.maps]
        if sizes[member] != table.size:
            raise ValueError(f"member {member} of the union has {sizes[member]} ids, its table {table.size}")
        #: where the member's vector starts when the union's members' vectors are laid end to end, and the
        #: position of the zero after them (:func:`gather_backed`)
        self.offset, self.pad = sum(sizes[:member]), sum(sizes)
        self.width = width = max(1, len(table.eos_ids), *map(len, table.ids_of.values()))
        self._rows = torch.full((len(union.keys) + 2, width), -1, dtype=torch.long)
        for j in range(width):
            pairs = [(union.index[key], ids[j]) for key, ids in table.ids_of.items() if len(ids) > j]
            if j < len(table.eos_ids):
                pairs.append((union.end, table.eos_ids[j]))
            if pairs:
                at, ids = zip(*pairs)
                self._rows[list(at), j] = torch.tensor(ids, dtype=torch.long)
        self._copies: dict[tuple[str, int], torch.Tensor] = {}  # by (device, width): see positions_on
        self._firsts: dict[int, tuple[int | None, int]] = {}  # union index -> (first sub-token or None, fill number)
        self._lock = threading.Lock()
        self.fills = 0

    def exact(self, u: int) -> bool:
        """Whether union string ``u`` is one of the member's tokens (or is the end of the text)."""
        return u == self._end or self._keys[u] in self._table.ids_of

    def ids(self, u: int) -> tuple[int, ...]:
        """The member's tokens with exactly union string ``u``'s text (its EOS ids for the end)."""
        return self._table.eos_ids if u == self._end else self._table.ids_of.get(self._keys[u], ())

    def learned(self, u: int) -> bool:
        return u in self._firsts

    def first(self, u: int) -> int | None:
        """The first token of the member's encoding of union string ``u``, once learned (None: not, or none)."""
        hit = self._firsts.get(u)
        return hit[0] if hit is not None else None

    def known(self, u: int, seen: int) -> bool:
        """Whether a gather queued when the table had ``seen`` fills holds ``u``'s backing."""
        hit = self._firsts.get(u)
        return self.exact(u) or (hit is not None and hit[1] <= seen)

    def learn(self, firsts: Sequence[tuple[int, int | None]]) -> None:
        """Record ``(union index, first sub-token id or None)`` pairs, on the host and on every device copy."""
        with self._lock:
            new = [(u, f) for u, f in firsts if u not in self._firsts]
            filled = [(u, f) for u, f in new if f is not None]
            if filled:
                at, values = (list(column) for column in zip(*filled))
                self._rows[at, 0] = torch.tensor(values, dtype=torch.long)
                for copy in self._copies.values():  # queued before any later gather on that device
                    copy[to_device(at, copy.device), 0] = to_device([self.offset + v for v in values], copy.device)
            for u, f in new:
                self.fills += 1
                self._firsts[u] = (f, self.fills)

    def positions_on(self, device: torch.device, width: int) -> torch.Tensor:
        """The table as positions in the members' vectors laid end to end (``[strings, width]``: the member's
        ids plus :attr:`offset`, the :attr:`pad` zero elsewhere), on ``device``, made once per device and width."""
        key = (str(device), width)
        with self._lock:
            copy = self._copies.get(key)
            if copy is None:
                rows = torch.full((self._rows.shape[0], width), self.pad, dtype=torch.long)
                rows[:, :self.width] = torch.where(self._rows >= 0, self._rows + self.offset, self.pad)
                copy = self._copies[key] = to_device(rows, device)
        return copy


#: Per device, a float32 zero: the :attr:`BackingTable.pad` entry after the members' vectors.
_ZEROS: dict[str, torch.Tensor] = {}


def gather_backed(backings: Sequence[BackingTable], probs: Sequence[torch.Tensor], at: torch.Tensor) -> torch.Tensor:
    """``[members, len(at)]``: each member's probability of each union string in ``at`` (the sum over the
    tokens that back it in its :class:`BackingTable`), where the probabilities are.

    ``backings`` and ``probs`` are every member of the union, in its order (float32 vectors on one device).
    Why one gather over the vectors laid end to end (#38): gathering member by member took six kernels per
    member (padding entries masked with a comparison, a clamp and a select) and a stack; on a GPU that
    launches kernels one at a time (~22 us each measured on the H200 box) a fusion step paid ~0.3 ms for
    them. Laid end to end with one zero after them, every member's entries are one index and one sum."""
    if len(backings) != len(probs) or any(b.pad != backings[0].pad for b in backings) or (
            backings[-1].offset + backings[-1].size != backings[0].pad):
        raise ValueError("gather_backed needs every member of one union, in its order")
    device, width = probs[0].device, max(b.width for b in backings)
    zero = _ZEROS.get(str(device))
    if zero is None:
        zero = _ZEROS.setdefault(str(device), torch.zeros(1, dtype=torch.float32, device=device))
    flat = torch.cat([*probs, zero])
    return flat[torch.stack([b.positions_on(device, width)[at] for b in backings])].sum(-1)


_BACKINGS: dict[tuple[int, int], tuple[UnionVocabulary, BackingTable]] = {}


def backing_table(union: UnionVocabulary, member: int, table: TokenTable) -> BackingTable:
    """The :class:`BackingTable` of member ``member`` (whose table is ``table``) over ``union``, built once."""
    key = (id(union), member)
    with _TABLE_LOCK:
        hit = _BACKINGS.get(key)
        if hit is not None and hit[0] is union:
            return hit[1]
    with _gc_paused():
        built = BackingTable(union, member, table)
    with _TABLE_LOCK:
        hit = _BACKINGS.get(key)
        if hit is None or hit[0] is not union:  # a concurrent first request may have built it meanwhile
            hit = _BACKINGS[key] = (union, built)
    return hit[1]


class GaC(Distribution):
    """Union vocabulary: full distributions mapped onto the union of token texts.

    The fused distribution covers the whole union; the returned candidates are its
    ``top_k × members`` most likely complete strings plus the drafter's own top-k, which
    carry all the mass that sharpening and choosing need. With prefixes, candidates are
    gathered per member (its top ``top_k × members`` after the prefix) and each member's
    probability of ``s`` is its union probability of ``prefix + s``.
    """

    name = "gac"

    def union_probs(self, probs: Sequence[torch.Tensor], drafter: int = 0) -> torch.Tensor:
        """Each member's distribution over the union vocabulary, ``[members, union + 2]``, where the drafter's are.

        Why there (#38): on a GPU, copying every member's whole vocabulary to the host per token
        (151k floats for Qwen) and projecting it there serialised every step; now only the
        chosen candidates' entries travel (:meth:`fuse`).
        """
        probs, _ = self._check(probs, drafter, None)
        device = probs[drafter].device
        union = self.union
        out = torch.zeros(len(probs), len(union.keys) + 2, device=device)
        for row, p, mapping in zip(out, probs, union.maps_on(device)):
            row.index_add_(0, mapping, p.to(device))
        return out

    def fuse(self, probs: Sequence[torch.Tensor], drafter: int = 0,
             prefixes: Sequence[bytes] | None = None, weights: torch.Tensor | None = None) -> Candidates:
        _, prefixes = self._check(probs, drafter, prefixes, weights)
        union = self.union
        per_member = self.union_probs(probs, drafter)
        k = self.top_k * len(self.members)
        order = [drafter] + [m for m in range(len(probs)) if m != drafter]
        if not any(prefixes):
            fused = weighted_mean(per_member, weights)
            picks = self._top_ids([per_member[drafter], fused], [union.selectable] * 2, [self.top_k, k])
            index = torch.cat(picks)  # the drafter's top-k, then the fused top: one may repeat the other
            rows = torch.cat([per_member[:, index], fused[index][None]])
            drafter_top, fused_top, values = read_together([*picks, rows])  # one read: the ids and their entries (#38)
            first: dict[int, int] = {}  # each candidate's first column, the drafter's first
            for i, u in enumerate(drafter_top + fused_top):
                first.setdefault(u, i)
            chosen = list(first)
            rows = torch.tensor(values, dtype=rows.dtype).view(len(probs) + 1, -1)[:, list(first.values())]
            top = torch.zeros(len(chosen), dtype=torch.bool)
            top[: len(drafter_top)] = True
            return Candidates(tuple(union.key(i) for i in chosen), rows[:-1], rows[-1], top, weights)
        tops: list[list[Key]] = []
        sizes = [self.top_k if m == drafter else k for m in range(len(prefixes))]
        for ids, prefix in zip(self._tops(list(per_member), [union.selectable] * len(prefixes), sizes), prefixes):
            stripped = (_strip_prefix(union.key(i), prefix) for i in ids)
            tops.append([key for key in stripped if key is not None])
        keys, drafter_top_mask = _gather_candidates(tops, order, drafter)
        at = [(m, c, pos) for m, prefix in enumerate(prefixes) for c, key in enumerate(keys)
              if (pos := union.position(key if isinstance(key, EndOfText) else prefix + key)) is not None]
        member_probs = torch.zeros(len(prefixes), len(keys))
        if at:  # gathered where the union rows are, in one transfer
            m_idx, c_idx, pos_idx = (torch.tensor(column, dtype=torch.long) for column in zip(*at))
            device = per_member.device
            member_probs[m_idx, c_idx] = per_member[m_idx.to(device), pos_idx.to(device)].cpu()
        return Candidates(tuple(keys), member_probs, weighted_mean(member_probs, weights), drafter_top_mask, weights)


#: The fusion rules by name (the names are :data:`ensemble_core.options.FUSION_RULES`).
DISTRIBUTIONS: dict[str, type[Distribution]] = {"unite": UniTE, "gac": GaC}
assert tuple(DISTRIBUTIONS) == FUSION_RULES


def make_distribution(name: str, members: Sequence[Any], top_k: int = 10, sub_tokens: str = "shared") -> Distribution:
    """The fusion rule called ``name`` (``unite`` or ``gac``) over ``members`` (``sub_tokens``: UniTE's only)."""
    if check_choice("distribution", name, FUSION_RULES) == "unite":
        return UniTE(members, top_k, sub_tokens)
    return DISTRIBUTIONS[name](members, top_k)


def fusion_weights(weights: Any, names: Sequence[str]) -> torch.Tensor | None:
    """Per-member fusion weights for members called ``names``, summing to 1 (None: uniform).

    ``weights`` is a config's ``fusion_weights``: one weight per member in member order,
    or a mapping from member names to weights where members left out weigh 1. Only the
    ratios matter (``[1, 1, 2]`` is ``[0.25, 0.25, 0.5]``).
    """
    option = normalize_weight_option(weights)
    if option is None:
        return None
    if option and isinstance(option[0], tuple):
        given = dict(option)  # type: ignore[arg-type]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise InvalidOptionError("fusion_weights", weights,
                                     f"weights for these members only: {', '.join(names)} (unknown: {', '.join(unknown)})")
        values = [given.get(name, 1.0) for name in names]
    else:
        values = list(option)  # type: ignore[arg-type]
        if len(values) != len(names):
            raise InvalidOptionError("fusion_weights", weights,
                                     f"{len(names)} weights, one per member in order: {', '.join(names)}")
    total = sum(values)
    if total <= 0:
        raise InvalidOptionError("fusion_weights", weights, WEIGHTS_EXPECTED)
    return torch.tensor([v / total for v in values])


def weighted_mean(member_probs: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The members' average over dim 0 (``member_probs[m, ...]``), weighted when ``weights`` are given."""
    if weights is None:
        return member_probs.mean(0)
    return torch.tensordot(to_device(weights, member_probs.device).to(member_probs.dtype), member_probs, dims=1)


# ============================================================================ sharpening
def _is_blank(key: Key) -> bool:
    return isinstance(key, bytes) and not key.decode("utf-8", errors="replace").strip()


@lru_cache(maxsize=64)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (a threshold compared as a tensor comparison would cast it), once per pair."""
    return float(torch.tensor(value, dtype=dtype))


def prefix_merge(keys: Sequence[Key], fused: torch.Tensor, drafter_top: torch.Tensor,
                 min_prob: float = PREFIX_MIN_PROB, read: tuple[list[float], list[bool]] | None = None) -> torch.Tensor:
    """SAFE's heuristic sharpening: a likely prefix collects the mass of its extensions.

    Every candidate ``s`` with fused probability > ``min_prob`` that is in the drafter's
    top-k and is not whitespace-only gets the mass of every other candidate that starts
    with ``s`` ("So" gathers "Sof" and "Sofia"): the models agree on ``s`` and only
    disagree on how to tokenize what follows. Other scores are unchanged. ``read``: ``fused`` and
    ``drafter_top`` as lists, when the caller has read them already.
    """
    scores = fused.clone()
    # read once, not per candidate (each element read is a host read); the threshold in fused's dtype, as
    # the tensor comparison casts it
    values, own = read if read is not None else read_together([fused, drafter_top])
    floor = _rounded(min_prob, fused.dtype)
    for i, s in enumerate(keys):
        if not isinstance(s, bytes) or values[i] <= floor or not own[i] or _is_blank(s):
            continue
        extra = [j for j, t in enumerate(keys) if j != i and isinstance(t, bytes) and t.startswith(s)]
        if extra:
            scores[i] = fused[i] + fused[extra].sum()
    return scores


def geometric_mean(member_probs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Score each candidate by ``(∏ p_m) ** (1/N)`` (weighted: ``∏ p_m ** w_m``): one member's doubt is a veto."""
    return torch.exp(weighted_mean(torch.log(member_probs.clamp_min(1e-12)), weights))


def sharpen(candidates: Candidates, rule: str = "heuristic", below: float = SHARPEN_BELOW) -> torch.Tensor:
    """Scores to choose from: the fused distribution, sharpened when its maximum is < ``below``.

    The result is normalised to sum to 1 so that it can also be sampled from.
    """
    check_choice("sharpening", rule, SHARPENINGS)
    scores = candidates.fused
    if rule != "none":
        read = read_together([scores, candidates.drafter_top])  # one read: the maximum and the prefix merge's inputs
        if max(read[0]) < below:
            if rule == "heuristic":
                scores = prefix_merge(candidates.keys, scores, candidates.drafter_top, read=(read[0], read[1]))
            else:
                scores = geometric_mean(candidates.member_probs, candidates.weights)
    total = scores.sum()  # normalised without reading the sum back
    return torch.where(total > 0, scores / total, torch.full_like(scores, 1.0 / len(scores)))
