"""Compare grammar-constrained decoding libraries for the ensemble (xgrammar, llguidance, outlines-core).

Run:  HF_HUB_OFFLINE=1 python docs/results/grammar/grammar_bench.py [--seeds 20] [--libs ...]
(libraries: xgrammar, llguidance, outlines_core; install them first)

Writes grammar_bench_results.json next to this file and prints markdown tables.

What is measured, per library and tokenizer (SmolLM2 49k byte-level BPE, Gemma-3 262k SentencePiece
with byte fallback, Qwen2.5 151k byte-level BPE from the bundled alias when installed):
  * tokenizer setup (one-time per tokenizer per process),
  * compile time of three constraints (small schema, 3-tool call anyOf, json_object), cold (fresh
    compiler) and cached (what a repeated request pays: cache hit + per-request state),
  * per-token mask time over constrained random-logit generations,
  * correctness: 100% of outputs must decode (with the project's decode flags) to JSON that validates,
    and the library's byte view must equal the decoded text; no special token / padding row is ever
    allowed except EOS at the end,
  * the operations the ensemble needs (accept token, rollback k, advance by non-token-aligned text,
    test a string without committing, can-end/finished, fork/copy cost, serialization, threads).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jsonschema  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

OUT = Path(__file__).with_name("grammar_bench_results.json")
QWEN_DIR = Path(os.environ.get("QWEN_TOKENIZER_DIR", "qwen_tok"))  # a saved Qwen2.5 tokenizer
PAD_ROWS = 64  # model rows beyond the tokenizer, to test vocab padding

# ----------------------------------------------------------------------------- schemas
SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue", "grün ✓"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "search_web", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"], "additionalProperties": False}},
    {"name": "send_email", "parameters": {
        "type": "object",
        "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"},
                       "cc": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
        "required": ["to", "subject", "body"], "additionalProperties": False}},
]
TOOL_CALL = {"anyOf": [
    {"type": "object",
     "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
     "required": ["name", "arguments"], "additionalProperties": False}
    for t in TOOLS]}
JSON_OBJECT = {"type": "object"}
SCHEMAS = {"small": SMALL, "tool_call": TOOL_CALL, "json_object": JSON_OBJECT}


# ----------------------------------------------------------------------------- tokenizers
def load_tokenizers() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from ensemble_core.testing import bundled_tokenizer

    toks = {"smollm2-49k-bpe": bundled_tokenizer("smollm2-135m-instruct"),
            "gemma3-262k-sp": bundled_tokenizer("gemma3-270m")}
    if QWEN_DIR.exists():
        from transformers import AutoTokenizer

        toks["qwen2.5-151k-bpe"] = AutoTokenizer.from_pretrained(str(QWEN_DIR))
    return toks


def special_ids(tok: Any) -> set[int]:
    return {int(k) for k, v in tok.added_tokens_decoder.items() if v.special} | {int(i) for i in tok.all_special_ids}


def token_bytes_table(tok: Any) -> list[bytes | None]:
    """Bytes of every token id (None for special tokens): the ground truth a grammar works on."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    u2b = {v: k for k, v in bytes_to_unicode().items()}
    specials = special_ids(tok)
    vocab = tok.get_vocab()
    table: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    sentencepiece = "<0x0A>" in vocab
    added = {v.content for v in tok.added_tokens_decoder.values()}
    for piece, i in vocab.items():
        if i in specials:
            continue
        if piece in added:  # non-special added tokens are literal text
            table[i] = piece.encode()
        elif sentencepiece:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                table[i] = bytes([int(piece[3:5], 16)])
            else:
                table[i] = piece.replace("\u2581", " ").encode()
        else:
            table[i] = bytes(u2b[c] for c in piece) if all(c in u2b for c in piece) else piece.encode()
    return table


def eos_ids(tok: Any) -> list[int]:
    ids = {tok.eos_token_id}
    for extra in ("<end_of_turn>", "<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(extra)
        if isinstance(i, int) and i != tok.unk_token_id and i is not None and i >= 0:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


def unpack(bitmask: torch.Tensor, v: int) -> torch.Tensor:
    bits = (bitmask.reshape(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:v].bool()


# ----------------------------------------------------------------------------- adapters
class Adapter:
    """Uniform face over one library: per-tokenizer setup, compile, per-request state, ops."""

    name = ""

    def setup(self, tok: Any, v: int, eos: list[int]) -> Any: ...
    def compile(self, env: Any, schema: dict, fresh: bool) -> Any: ...
    def state(self, env: Any, compiled: Any) -> Any: ...
    def fill(self, st: Any, bm: torch.Tensor) -> None: ...
    def accept(self, st: Any, tok_id: int) -> bool: ...
    def rollback(self, st: Any, k: int) -> None: ...
    def accept_text(self, env: Any, st: Any, text: str) -> int: ...  # returns #steps consumed (for rollback); -1 = rejected
    def accepts_text(self, env: Any, st: Any, text: str) -> bool: ...
    def can_end(self, st: Any) -> bool: ...
    def finished(self, st: Any) -> bool: ...
    def copy(self, st: Any) -> Any: ...
    def serialize(self, env: Any, compiled: Any) -> tuple[int, float, float]: ...


class XGrammar(Adapter):
    name = "xgrammar"

    def setup(self, tok, v, eos):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=v, stop_token_ids=eos)
        return {"info": info, "compiler": xgr.GrammarCompiler(info, max_threads=2), "xgr": xgr}

    def compile(self, env, schema, fresh):
        xgr = env["xgr"]
        comp = xgr.GrammarCompiler(env["info"], max_threads=2) if fresh else env["compiler"]
        if schema == JSON_OBJECT:
            return comp.compile_json_schema(schema, strict_mode=False)
        return comp.compile_json_schema(schema)

    def state(self, env, compiled):
        return env["xgr"].GrammarMatcher(compiled)

    def fill(self, st, bm):
        st.fill_next_token_bitmask(bm)

    def accept(self, st, tok_id):
        return st.accept_token(tok_id)

    def rollback(self, st, k):
        st.rollback(k)

    def accept_text(self, env, st, text):
        return 1 if st.accept_string(text) else -1

    def accepts_text(self, env, st, text):
        f = st.fork()
        return f.accept_string(text)

    def can_end(self, st):
        return st.is_completed()

    def finished(self, st):
        return st.is_terminated()

    def copy(self, st):
        return st.fork()

    def serialize(self, env, compiled):
        t0 = time.perf_counter()
        s = compiled.serialize_json()
        t1 = time.perf_counter()
        env["xgr"].CompiledGrammar.deserialize_json(s, env["info"])
        t2 = time.perf_counter()
        return len(s), t1 - t0, t2 - t1


class LLGuidance(Adapter):
    name = "llguidance"
    fast = False

    def setup(self, tok, v, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        if self.fast:  # ensemble_core.constraints.grammar' vocabulary reader (no tokenizer.json round trip)
            sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
            from ensemble_core.constraints.grammar import _Vocabulary, token_table

            tokens, special = token_table(tok)
            tokens = tokens + [b""] * (v - len(tokens))
            lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, tokens, special)), n_vocab=v,
                                        eos_token=eos)
        else:
            lt = llguidance.hf.from_tokenizer(tok, n_vocab=v, eos_token=eos)
        return {"tok": lt, "llg": llguidance, "cache": {}}

    def compile(self, env, schema, fresh):
        llg = env["llg"]
        key = json.dumps(schema, sort_keys=True)
        if not fresh and key in env["cache"]:
            return env["cache"][key]
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        m = llg.LLMatcher(env["tok"], grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        env["cache"][key] = m  # a pristine template; requests deep_copy it
        return m

    def state(self, env, compiled):
        return compiled.deep_copy()

    def fill(self, st, bm):
        st.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4)

    def accept(self, st, tok_id):
        # consume_token() on a rejected token puts the matcher into a permanent error state;
        # try_consume_tokens() checks first and leaves the state unchanged on rejection
        return st.try_consume_tokens([tok_id]) == 1

    def rollback(self, st, k):
        st.rollback(k)

    def _ids(self, env, text):
        ids = env["tok"].greedy_tokenize(text)
        assert env["tok"].decode_bytes(ids) == text.encode(), "greedy tokenization must be byte-exact"
        return ids

    def accept_text(self, env, st, text):
        ids = self._ids(env, text)
        n = st.try_consume_tokens(ids)
        if n < len(ids):
            st.rollback(n)
            return -1
        return len(ids)

    def accepts_text(self, env, st, text):
        ids = self._ids(env, text)
        return st.validate_tokens(ids) == len(ids)

    def can_end(self, st):
        return st.is_accepting()

    def finished(self, st):
        return st.is_stopped()

    def copy(self, st):
        return st.deep_copy()

    def serialize(self, env, compiled):
        # the compiled artifact *is* the grammar string (JSON); the matcher is rebuilt from it
        g = env["llg"].LLMatcher.grammar_from_json_schema(SMALL)
        t0 = time.perf_counter()
        s = json.dumps(g)
        t1 = time.perf_counter()
        env["llg"].LLMatcher(env["tok"], json.loads(s), log_level=0)
        t2 = time.perf_counter()
        return len(s), t1 - t0, t2 - t1


class OutlinesCore(Adapter):
    name = "outlines_core"

    def setup(self, tok, v, eos):
        import outlines_core as oc

        table = token_bytes_table(tok)
        mapping: dict[bytes, list[int]] = {}
        for i, b in enumerate(table):
            if b is not None and i not in eos:
                mapping.setdefault(b, []).append(i)
        byte_ids = {}
        for b, ids in mapping.items():
            if len(b) == 1:
                byte_ids[b[0]] = ids[0]
        return {"voc": oc.Vocabulary(eos[0], mapping), "oc": oc, "cache": {}, "byte_ids": byte_ids, "eos": eos}

    def compile(self, env, schema, fresh):
        oc = env["oc"]
        key = json.dumps(schema, sort_keys=True)
        if not fresh and key in env["cache"]:
            return env["cache"][key]
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), None)
        idx = oc.Index(regex, env["voc"])
        env["cache"][key] = idx
        return idx

    def state(self, env, compiled):
        return env["oc"].Guide(compiled, max_rollback=512)

    def fill(self, st, bm):
        bm.zero_()
        st.write_mask_into(bm.data_ptr(), bm.numel(), 4)

    def accept(self, st, tok_id):
        try:
            st.advance(tok_id, return_tokens=False)
            return True
        except Exception:
            return False

    def rollback(self, st, k):
        st.rollback_state(k)

    def accept_text(self, env, st, text):
        ids = [env["byte_ids"][b] for b in text.encode()]
        if not st.accepts_tokens(ids):
            return -1
        for i in ids:
            st.advance(i, return_tokens=False)
        return len(ids)

    def accepts_text(self, env, st, text):
        return st.accepts_tokens([env["byte_ids"][b] for b in text.encode()])

    def can_end(self, st):
        return st.is_finished()

    def finished(self, st):
        return st.is_finished() and len(st.get_tokens()) <= 1

    def copy(self, st):
        return pickle.loads(pickle.dumps(st))

    def serialize(self, env, compiled):
        t0 = time.perf_counter()
        s = pickle.dumps(compiled)
        t1 = time.perf_counter()
        pickle.loads(s)
        t2 = time.perf_counter()
        return len(s), t1 - t0, t2 - t1


class LLGuidanceFast(LLGuidance):
    name = "llguidance_fast"
    fast = True


ADAPTERS = {a.name: a for a in (XGrammar(), LLGuidance(), LLGuidanceFast(), OutlinesCore())}


# ----------------------------------------------------------------------------- generation
class TokInfo:
    def __init__(self, name: str, tok: Any) -> None:
        self.name, self.tok = name, tok
        self.n = len(tok)
        self.v = self.n + PAD_ROWS
        self.eos = eos_ids(tok)
        self.table = token_bytes_table(tok)
        self.specials = special_ids(tok)
        closing = torch.zeros(self.v, dtype=torch.bool)
        for i, b in enumerate(self.table):
            if b and set(b) <= set(b'"}]'):
                closing[i] = True
        self.closing = closing
        self.no_ws = torch.tensor([bool(b) and not any(c in b for c in b" \n\r\t") for b in self.table]
                                  + [False] * (self.v - len(self.table)))
        self.never = torch.zeros(self.v, dtype=torch.bool)
        self.never[self.n:] = True
        for i in self.specials:
            if i not in self.eos:
                self.never[i] = True


def generate(ad: Adapter, env: Any, ti: TokInfo, st: Any, seed: int, budget: int = 40, cap: int = 400) -> dict:
    """Random-logit constrained sampling; after ``budget`` tokens prefer closing tokens so it ends."""
    gen = torch.Generator().manual_seed(seed)
    bm = torch.zeros((ti.v + 31) // 32, dtype=torch.int32)
    ids: list[int] = []
    mask_times: list[float] = []
    eos_set = set(ti.eos)
    bad_allowed = 0
    ended = False
    for step in range(cap):
        t0 = time.perf_counter()
        ad.fill(st, bm)
        mask_times.append(time.perf_counter() - t0)
        allowed = unpack(bm, ti.v)
        bad_allowed += int((allowed & ti.never).sum())
        eos_allowed = any(bool(allowed[e]) for e in ti.eos)
        if eos_allowed != ad.can_end(st):
            bad_allowed += 1000000  # can_end and the EOS bit disagree
        logits = torch.randn(ti.v, generator=gen)
        if step >= budget:
            if eos_allowed:
                ids.append(next(e for e in ti.eos if allowed[e]))
                ended = True
                break
            for pref in (allowed & ti.closing, allowed & ti.no_ws):
                if pref.any():
                    allowed = pref
                    break
        logits[~allowed] = float("-inf")
        if not allowed.any():
            break
        else:
            # do not pick EOS before the budget unless it is the only option
            cand = logits.clone()
            n_eos_allowed = sum(bool(allowed[e]) for e in ti.eos)
            if step < budget and int(allowed.sum()) > n_eos_allowed:
                for e in ti.eos:
                    cand[e] = float("-inf")
            pick = int(cand.argmax())
        if pick in eos_set:  # EOS is the caller's business: allowed iff can_end (checked above)
            ids.append(pick)
            ended = True
            break
        ok = ad.accept(st, pick)
        if not ok:
            return {"ok": False, "why": f"accept_token rejected an allowed token {pick}", "mask_times": mask_times}
        ids.append(pick)
        if pick in eos_set:
            ended = True
            break
    body = [i for i in ids if i not in eos_set]
    text = ti.tok.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    lib_bytes = b"".join(ti.table[i] or b"<SPECIAL>" for i in body)
    return {"ok": ended, "text": text, "lib_view_equal": lib_bytes == text.encode(), "bad_allowed": bad_allowed,
            "n_tokens": len(ids), "mask_times": mask_times, "why": "" if ended else "no EOS within cap"}


def validate(text: str, schema: dict) -> str:
    try:
        value = json.loads(text)
    except Exception as e:  # noqa: BLE001
        return f"json: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    if schema is JSON_OBJECT and not isinstance(value, dict):
        return "not an object"
    return ""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------- operations
def check_ops(ad: Adapter, env: Any, ti: TokInfo) -> dict:
    res: dict[str, Any] = {}
    comp = ad.compile(env, SMALL, fresh=False)
    st = ad.state(env, comp)
    bm = torch.zeros((ti.v + 31) // 32, dtype=torch.int32)

    def mask() -> torch.Tensor:
        ad.fill(st, bm)
        return unpack(bm, ti.v).clone()

    m0 = mask()
    # advance by text that ends mid-word / mid-token, then the mask must continue correctly
    n1 = ad.accept_text(env, st, '{"name": "Ann", "age": 7, "color": "red", "address": {"city": "Zürich Hauptbahnh')
    res["accept_text_mid_word"] = n1 >= 0
    m1 = mask()
    # tokens that continue the string must be allowed, e.g. 'of' and '"' and the EOS must not be
    ids_of = ti.tok.encode("of", add_special_tokens=False)
    quote = ti.tok.convert_tokens_to_ids('"')
    res["mask_after_text_ok"] = bool(m1[ids_of[0]]) and bool(m1[quote]) and not any(bool(m1[e]) for e in ti.eos)
    # which tokens that are not plain text does the mask allow inside a JSON string?
    added_ns = [k for k, t in ti.tok.added_tokens_decoder.items() if not t.special and k < ti.n]
    tag_like = [k for k in added_ns if ti.tok.convert_ids_to_tokens(k).startswith("<")]
    gguf_pad = [i for i, p in enumerate(ti.tok.convert_ids_to_tokens(list(range(ti.n)))) if p and p.startswith("[PAD")]
    res["in_string_allowed"] = {
        "special": int(m1[sorted(ti.specials)].sum()), "pad_rows": int(m1[ti.n:].sum()),
        "added_nonspecial": f"{int(m1[added_ns].sum()) if added_ns else 0}/{len(added_ns)}",
        "added_tag_like": f"{int(m1[tag_like].sum()) if tag_like else 0}/{len(tag_like)}",
        "gguf_[PAD]_tokens": f"{int(m1[gguf_pad].sum()) if gguf_pad else 0}/{len(gguf_pad)}"}
    # accepts_text leaves state unchanged
    a_good = ad.accepts_text(env, st, 'of", "zip": "80')
    a_bad = ad.accepts_text(env, st, 'of", "zap": "80')
    res["accepts_text_good_bad"] = (a_good, a_bad)
    res["accepts_text_no_state_change"] = bool(torch.equal(mask(), m1))
    res["rejected_text_leaves_state"] = ad.accept_text(env, st, 'of", 7') < 0 and bool(torch.equal(mask(), m1))
    # roll back a drafted run of 16 tokens: mask must equal the one before the draft
    draft = ti.tok.encode('of", "zip": "8001"}}', add_special_tokens=False)
    steps = 0
    for i in draft:
        if not ad.accept(st, i):
            break
        steps += 1
    res["draft_tokens_accepted"] = f"{steps}/{len(draft)}"
    res["can_end_after_complete"] = ad.can_end(st)
    res["finished_after_complete"] = ad.finished(st)
    ad.rollback(st, steps)
    res["rollback_restores_mask"] = bool(torch.equal(mask(), m1))
    res["can_end_mid"] = ad.can_end(st)
    # rollback of the text advance too (to the start)
    try:
        ad.rollback(st, n1)
        res["rollback_text_advance"] = bool(torch.equal(mask(), m0))
    except Exception as e:  # noqa: BLE001
        res["rollback_text_advance"] = f"error: {e}"
    # long rollback (64 tokens)
    st2 = ad.state(env, comp)
    long = ti.tok.encode('{"name": "A", "age": 1, "color": "red", "address": {"city": "' + "a b c d " * 12,
                         add_special_tokens=False)[:64]
    k = 0
    for i in long:
        if ad.accept(st2, i):
            k += 1
    try:
        ad.rollback(st2, k)
        bm2 = torch.zeros_like(bm)
        ad.fill(st2, bm2)
        res["rollback_64"] = f"{k} tokens ok" if torch.equal(unpack(bm2, ti.v), m0) else "mask differs"
    except Exception as e:  # noqa: BLE001
        res["rollback_64"] = f"error: {e}"
    # per-request state / copy costs
    t0 = time.perf_counter()
    for _ in range(20):
        ad.state(env, comp)
    res["new_state_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    t0 = time.perf_counter()
    for _ in range(20):
        ad.copy(st)
    res["copy_state_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    try:
        size, ser, de = ad.serialize(env, comp)
        res["serialize"] = {"bytes": size, "ser_ms": ser * 1e3, "deser_ms": de * 1e3}
    except Exception as e:  # noqa: BLE001
        res["serialize"] = f"error: {e}"
    # two threads, separate states on one compiled grammar: same masks as sequential
    comp2 = ad.compile(env, TOOL_CALL, fresh=False)
    seq = []
    for seed in (1, 2):
        s = ad.state(env, comp2)
        seq.append(generate(ad, env, ti, s, seed)["text"])
    par: list[str] = ["", ""]

    def work(j: int) -> None:
        s = ad.state(env, comp2)
        par[j] = generate(ad, env, ti, s, j + 1)["text"]

    ths = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    res["threads_same_result"] = par == seq
    return res


# ----------------------------------------------------------------------------- main
def install_info(libs: list[str]) -> dict:
    site = Path(md.distribution("torch").locate_file(""))
    out = {}
    extra = {"xgrammar": ["apache-tvm-ffi", "triton"], "llguidance": [], "outlines_core": []}
    for lib in [x for x in libs if x in extra]:
        dist = md.distribution(lib.replace("_", "-"))
        reqs = [r for r in (dist.requires or []) if "extra ==" not in r]

        def size(name: str) -> float:
            d = md.distribution(name)
            return sum((site / str(f)).stat().st_size for f in d.files or [] if (site / str(f)).exists()) / 2**20

        out[lib] = {"version": dist.version, "requires": reqs, "own_MiB": round(size(lib.replace("_", "-")), 1),
                    "new_deps_MiB": {e: round(size(e), 1) for e in extra[lib]}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--libs", default="xgrammar,llguidance,llguidance_fast,outlines_core")
    ap.add_argument("--toks", default="")
    args = ap.parse_args()
    libs = args.libs.split(",")
    results: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                               "install": install_info(libs), "runs": {}}
    print(json.dumps(results["install"], indent=1))
    toks = load_tokenizers()
    for tname, tok in toks.items():
        if args.toks and tname not in args.toks.split(","):
            continue
        ti = TokInfo(tname, tok)
        print(f"== {tname}: len={ti.n} V={ti.v} eos={ti.eos} specials={len(ti.specials)}", flush=True)
        for lib in libs:
            ad = ADAPTERS[lib]
            r: dict[str, Any] = {}
            t0 = time.perf_counter()
            env = ad.setup(tok, ti.v, ti.eos)
            r["setup_s"] = time.perf_counter() - t0
            for sname, schema in SCHEMAS.items():
                sr: dict[str, Any] = {}
                try:
                    t0 = time.perf_counter()
                    comp = ad.compile(env, schema, fresh=True)
                    st = ad.state(env, comp)
                    bm = torch.zeros((ti.v + 31) // 32, dtype=torch.int32)
                    ad.fill(st, bm)
                    sr["cold_ms"] = (time.perf_counter() - t0) * 1e3
                    comp = ad.compile(env, schema, fresh=False)  # warm the shared cache
                    t0 = time.perf_counter()
                    comp = ad.compile(env, schema, fresh=False)
                    st = ad.state(env, comp)
                    ad.fill(st, bm)
                    sr["cached_ms"] = (time.perf_counter() - t0) * 1e3
                except Exception as e:  # noqa: BLE001
                    sr["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"  {lib:14s} {sname:11s} ERROR {sr['error']}", flush=True)
                    r[sname] = sr
                    continue
                times: list[float] = []
                fails: list[str] = []
                lens = []
                bad = 0
                view_diff = 0
                samples = []
                for seed in range(args.seeds):
                    st = ad.state(env, comp)
                    g = generate(ad, env, ti, st, seed)
                    times += g["mask_times"]
                    if not g["ok"]:
                        fails.append(g["why"])
                        continue
                    lens.append(g["n_tokens"])
                    bad += g["bad_allowed"]
                    view_diff += not g["lib_view_equal"]
                    err = validate(g["text"], schema)
                    if err:
                        fails.append(f"{err} :: {g['text'][:200]!r}")
                    if len(samples) < 2:
                        samples.append(g["text"][:160])
                sr.update({
                    "valid": f"{args.seeds - len(fails)}/{args.seeds}", "fail_examples": fails[:3],
                    "mask_mean_us": statistics.mean(times) * 1e6, "mask_p95_us": pct(times, 0.95) * 1e6,
                    "mask_max_us": max(times) * 1e6, "tokens_mean": statistics.mean(lens) if lens else 0,
                    "special_or_pad_allowed": bad, "lib_view_differs": view_diff, "samples": samples})
                r[sname] = sr
                print(f"  {lib:14s} {sname:11s} cold={sr['cold_ms']:9.1f}ms cached={sr['cached_ms']:7.2f}ms "
                      f"mask mean={sr['mask_mean_us']:8.1f}us p95={sr['mask_p95_us']:8.1f}us valid={sr['valid']} "
                      f"bad={bad} viewdiff={view_diff} len={sr['tokens_mean']:.0f} {fails[:1]}", flush=True)
            try:
                r["ops"] = check_ops(ad, env, ti)
            except Exception as e:  # noqa: BLE001
                r["ops"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  {lib:14s} setup={r['setup_s']:.2f}s ops={json.dumps(r['ops'])}", flush=True)
            results["runs"].setdefault(tname, {})[lib] = r
            OUT.write_text(json.dumps(results, indent=1, default=str))
    OUT.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
