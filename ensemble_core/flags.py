"""Command-line flags shared by ``ensemble``, ``ensemble serve`` and ``ensemble bench``.

One place for how members, their load options and ``--set method.option=value`` are read
from a command line, so that every command reads them the same way.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ensemble_core.decoding.members import Member
from ensemble_core.ensemble import DEFAULT_MEMBERS, resolve_members
from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.loading import DEFAULT_PREFIX_CACHE, PASS_MODES, per_member_options
from ensemble_core.models.quantize import SCHEMES


# ---------------------------------------------------------------------------- parsing helpers
def parse_value(text: str) -> Any:
    """A ``--set`` value: JSON when it parses (numbers, true/false/null, lists, quoted strings), else the raw string."""
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_sets(items: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """``["lookahead=3", "specem.segment_length=8"]`` → ``{"*": {"lookahead": 3}, "specem": {"segment_length": 8}}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidOptionError("--set", item, "key=value (or method.key=value)")
        method, dot, name = key.rpartition(".")
        out.setdefault(method if dot else "*", {})[name.replace("-", "_")] = parse_value(value)
    for values in out.values():
        if isinstance(values.get("stop"), list):
            values["stop"] = tuple(values["stop"])
    return out


#: The prefix cache of members whose runs are timed against each other (``ensemble demo``, ``ensemble bench``):
#: off, because rows share their members, and a row that runs a prompt after another would find it prefilled
#: (and the benchmark's ``single`` rows run transformers' ``generate``, which has no such cache).
TIMED_PREFIX_CACHE = 0


def member_options(args: argparse.Namespace, count: int) -> list[dict[str, Any]]:
    """Per-member load options from ``--device``, ``--dtype``, ``--quantize`` (one for all or one each), ``--prepack``."""
    return per_member_options(count, args.dtype, args.device or (), args.quantize or (), prepack_flag(args.prepack),
                              args.passes, args.prefix_cache)


def prepack_flag(value: str) -> bool | None:
    """``--prepack auto|on|off`` as ``MemberSpec.prepack`` (None: when the copy fits in memory)."""
    return {"auto": None, "on": True, "off": False}[value]


def load_members(args: argparse.Namespace) -> list[Member]:
    names = list(args.members or DEFAULT_MEMBERS)
    return [resolve_members([name], **opts)[0] for name, opts in zip(names, member_options(args, len(names)))]


def add_member_flags(p: argparse.ArgumentParser, default_members: bool = True,
                     prefix_cache: int = DEFAULT_PREFIX_CACHE) -> None:
    p.add_argument("--members", nargs="+", metavar="MEMBER", default=None,
                   help="aliases, local directories, .gguf files or Hugging Face ids "
                        f"(default: {' '.join(DEFAULT_MEMBERS)})")
    add_load_flags(p, prefix_cache)


def add_load_flags(p: argparse.ArgumentParser, prefix_cache: int = DEFAULT_PREFIX_CACHE) -> None:
    """``--device``, ``--dtype``, ``--quantize``, ``--prepack``, ``--passes``, ``--prefix-cache``: how members load and run
    (read by :func:`member_options`). ``prefix_cache``: the flag's default (0 where runs are timed against each
    other: :data:`TIMED_PREFIX_CACHE`)."""
    p.add_argument("--device", nargs="+", metavar="DEVICE", default=None,
                   help="one device for all members or one per member, e.g. --device cuda:0 cuda:1 (default cpu)")
    p.add_argument("--dtype", nargs="+", default=["auto"], choices=["auto", "float32", "float16", "bfloat16"],
                   help="one dtype for all members or one per member (auto: float32 on CPU, bfloat16 on GPU; "
                        "on a CPU with native bf16, AVX512-BF16 or AMX, bfloat16 is faster: docs/benchmarks.md)")
    p.add_argument("--quantize", nargs="+", metavar="SCHEME", default=None, choices=["none", *SCHEMES],
                   help="one scheme for all members or one per member, e.g. --quantize none int8: int8 makes a "
                        "CPU member's linear layers dynamic int8 (faster, different greedy outputs)")
    p.add_argument("--prepack", default="auto", choices=["auto", "on", "off"],
                   help="a second, prepacked copy of a float32 CPU member's linear weights makes passes of several "
                        "tokens 1.2-2x faster with the same outputs (auto: when it fits easily in memory)")
    p.add_argument("--passes", default="eager", choices=list(PASS_MODES),
                   help="how members run their forward passes: eager (default), static (fixed shapes over a "
                        "preallocated KV slot) or graphs (static, replayed as CUDA graphs on a GPU; experimental): "
                        "docs/gpu.md")
    p.add_argument("--prefix-cache", type=int, default=prefix_cache, metavar="TOKENS",
                   help="tokens of recent prompts whose KV states each member keeps, so that a request that starts "
                        f"like one of them prefills only the rest (default {prefix_cache}; 0: off)")

