"""Per-pass cost table of a benchmark run: forward passes, tokens fed per pass, ms per pass and
share of wall time, per method row and member (from the ``members`` stats of every record).

    python docs/results/trio/cost_table.py docs/results/trio/gsm8k/results.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def table(recs: list[dict]) -> str:
    passes: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    wall: dict[str, float] = defaultdict(float)
    out_tokens: dict[str, int] = defaultdict(int)
    for r in recs:
        if "error" in r or r["kind"] == "single":
            continue
        wall[r["method"]] += r["latency_s"]
        out_tokens[r["method"]] += r["tokens"]
        for m in r["stats"].get("members", []):
            acc = passes[(r["method"], m["name"], m.get("role", "member"))]
            acc[0] += m["forward_passes"]
            acc[1] += m["tokens_fed"]
            acc[2] += m["seconds"]
    lines = ["| method | member (role) | forward passes | tokens fed per pass | ms per pass | share of wall time |",
             "|---|---|---|---|---|---|"]
    for (method, name, role), (n, fed, sec) in passes.items():
        lines.append(f"| {method} | {name} ({role}) | {n} | {fed / n:.1f} | {1000 * sec / n:.0f} | "
                     f"{sec / wall[method]:.0%} |")
    singles: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in recs:
        if r["kind"] == "single" and "error" not in r:
            singles[r["method"]][0] += r["tokens"]
            singles[r["method"]][1] += r["latency_s"]
    for label, (tokens, sec) in singles.items():
        lines.append(f"| {label} (HF generate) | | {tokens} tokens | 1 | {1000 * sec / tokens:.0f} per token | |")
    lines.append("")
    lines.append("| method | output tokens | ms per output token (primary tokenizer) |")
    lines.append("|---|---|---|")
    for method in wall:
        lines.append(f"| {method} | {out_tokens[method]} | {1000 * wall[method] / max(out_tokens[method], 1):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(records(Path(sys.argv[1]))))
