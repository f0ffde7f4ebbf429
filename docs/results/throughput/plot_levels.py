"""The throughput curves of docs/benchmarks.md: speed-up over one-by-one vs concurrent requests, per method.

``python docs/results/throughput/plot_levels.py OUT.png RUN_DIR [RUN_DIR ...]``: one line per
method and run (``throughput.json`` of ``ensemble bench --throughput``), the targets at 8
concurrent requests as markers. Levels whose baseline was estimated from fewer requests are
drawn all the same (the table says "est.").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file backend

from ensemble_core.bench.targets import load_targets  # noqa: E402

TARGETS_AT_8 = {t.value["throughput"]: t.threshold for t in load_targets()
                if "throughput" in t.value and t.value.get("concurrency") == 8}
COLOURS = {"single": "tab:blue", "safe": "tab:orange", "specem": "tab:green"}
STYLES = ["-", "--", ":", "-."]


def main() -> None:
    out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k, run in enumerate(runs):
        results = json.loads((run / "throughput.json").read_text())["results"]
        for method, res in results.items():
            levels = sorted((int(c), lv["speedup"]) for c, lv in res["levels"].items() if lv["speedup"] is not None)
            ax.plot([c for c, _ in levels], [s for _, s in levels], STYLES[k % len(STYLES)], marker="o",
                    color=COLOURS.get(method), label=f"{method}, run {run.name.split('-')[0]}")
    for method, target in TARGETS_AT_8.items():
        ax.plot([8], [target], marker="*", markersize=13, color=COLOURS[method], linestyle="none")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 8, 16], labels=["1", "4", "8", "16"])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total tokens/s, x one after another")
    ax.set_title("Batched decoding, SmolLM2 + Gemma-3, 64 tokens (stars: targets at 8)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
