"""Summarise the Hedge reward comparison runs in this folder (docs/benchmarks.md, "Hedge reward").

    python docs/results/hedge/summarize.py
"""

import json
from pathlib import Path


def main() -> None:
    for run in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir()):
        records = [json.loads(line) for line in (run / "results.jsonl").open()]
        weights = [r["stats"]["final_weights"] for r in records]
        moved = sum(max(w) - min(w) > 1e-9 for w in weights)
        mean = [round(sum(w[i] for w in weights) / len(weights), 3) for i in range(len(weights[0]))]
        spread = max(round(max(w) - min(w), 3) for w in weights)
        correct = sum(bool(r["correct"]) for r in records)
        print(f"{run.name}: {correct}/{len(records)} correct, weights moved on {moved}/{len(records)}, "
              f"mean final weights {mean}, largest spread {spread}")


if __name__ == "__main__":
    main()
