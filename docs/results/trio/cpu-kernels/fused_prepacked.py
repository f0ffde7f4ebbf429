"""Per-member cost of a step and of a k-token pass with and without fused projections and prepacked weights.

Run on a quiet machine: ``python docs/results/trio/cpu-kernels/fused_prepacked.py [threads] [rounds]``.
Each bundled member is loaded once (float32, the default); three layouts of the same
weights are switched in place between measurements: ``plain`` (every linear layer its own
dense oneDNN product, as before), ``prepacked`` (products of 2+ rows read a prepacked copy)
and ``fused+prepacked`` (q/k/v and gate/up stacked into one product, the default now). For
each, ``DecodeState.score`` of k new tokens after ~250 cached ones (k = 1 is a decode step,
k > 1 a verify window or a batched pass), cropped back after each; the layouts take turns in
every round (the order rotates) so that drift hits all three. Also checks that the three
give the same logits bit for bit. Prints a markdown table and writes ``fused_prepacked.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ensemble_core import Member
from ensemble_core.models.loading import cpu_model
from ensemble_core.models.products import CpuLinear, prepack

PROMPT = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
          "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
          "per fresh duck egg. How much in dollars does she make every day at the farmers' market? "
          "Let's think step by step.")
MEMBERS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
LAYOUTS = ("plain", "prepacked", "fused+prepacked")
WINDOWS = (1, 2, 4, 8, 12)


class Layouts:
    """Switches one loaded model between the three layouts (the packed copies are kept aside, not rebuilt)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.groups = list({id(g): g for g in (m.__dict__["_group"][0] for m in model.modules()
                                                 if "_group" in m.__dict__)}.values())
        self.single = [m for m in model.modules() if type(m) is CpuLinear and "_group" not in m.__dict__]
        self.single_packed = [m.__dict__.get("_packed") for m in self.single]
        self.group_packed = [g.packed for g in self.groups]
        # the grouped layers' own packed copies, for "prepacked" without stacking
        self.member_packed = {id(layer): entry for g in self.groups for layer in g.layers
                              for entry in [_pack_entry(layer)]}

    def use(self, layout: str) -> None:
        packed = layout != "plain"
        for m, entry in zip(self.single, self.single_packed):
            m.__dict__["_packed"] = entry if packed else None
        for g, copy in zip(self.groups, self.group_packed):
            g.stacking = layout == "fused+prepacked"
            g.packed = copy if g.stacking else None
            for layer in g.layers:
                layer.__dict__["_packed"] = self.member_packed[id(layer)] if layout == "prepacked" else None
                # an unstacked group computes each layer's own product: route it through the layer's packed copy
                layer.__dict__["_group"] = (g, g.layers.index(layer)) if g.stacking else None


def _pack_entry(layer: CpuLinear) -> object:
    """What ``CpuLinear.pack`` keeps, for a layer whose group normally serves it."""
    return prepack(layer.weight), layer.weight._version, layer.weight.data_ptr()


def warm_state(member: Member) -> object:
    state = member.start(PROMPT)
    rows = state.score()
    for _ in range(150):
        rows = state.score([int(rows[-1].argmax())])
    return state


def window(state: object, k: int) -> tuple[float, torch.Tensor]:
    base = len(state.ids)
    t0 = time.perf_counter()
    rows = state.score([100 + i for i in range(k)])
    took = time.perf_counter() - t0
    state.crop(base)
    state.score()
    return took * 1e3, rows


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "rounds": rounds, "cpu": cpu_model(), "torch": torch.__version__, "members": {}}
    for name in MEMBERS:
        member = Member.load(name)
        layouts = Layouts(member.model)
        state = warm_state(member)
        times: dict = {lay: {k: [] for k in WINDOWS} for lay in LAYOUTS}
        identical = True
        for r in range(rounds):
            order = LAYOUTS[r % 3:] + LAYOUTS[:r % 3]
            rows: dict = {}
            for lay in order:
                layouts.use(lay)
                for k in WINDOWS:
                    ms, got = window(state, k)
                    times[lay][k].append(ms)
                    rows[(lay, k)] = got
            identical &= all(torch.equal(rows[("plain", k)], rows[(lay, k)]) for lay in LAYOUTS for k in WINDOWS)
        layouts.use("fused+prepacked")
        out["members"][name] = {"ms": {lay: {k: statistics.median(v) for k, v in times[lay].items()} for lay in LAYOUTS},
                                "identical_logits": identical}
        del member, state
    lines = ["| member | layout | " + " | ".join(f"{k} tok" for k in WINDOWS) + " | step speed-up | 8-tok speed-up |",
             "|---|---|" + "---:|" * (len(WINDOWS) + 2)]
    for name, m in out["members"].items():
        base = m["ms"]["plain"]
        for lay in LAYOUTS:
            ms = m["ms"][lay]
            lines.append(f"| {name} | {lay} | " + " | ".join(f"{ms[k]:.0f}" for k in WINDOWS)
                         + f" | {base[1] / ms[1]:.2f}x | {base[8] / ms[8]:.2f}x |")
    lines.append("")
    lines.append("identical logits: " + ", ".join(f"{n} {m['identical_logits']}" for n, m in out["members"].items()))
    print("\n".join(lines))
    Path(__file__).with_name("fused_prepacked.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
