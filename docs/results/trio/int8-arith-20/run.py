"""The run behind this directory: Qwen2.5-Coder in float32 and in dynamic int8 as two
members of ONE interleaved bench run (the int8 copy is named ``qwen-int8`` so that the
rows can be told apart), SmolLM2 drafting for each in a pair.

    python docs/results/trio/int8-arith-20/run.py 2 arith 20 48 results/int8-arith-20

Arguments: torch threads, dataset, questions, max new tokens, output directory. The
``safe[drafter=smollm2-135m-instruct]`` row (all three members, two of them the same
model) has no meaning of its own; the pair rows and the singles are the comparison.
"""

import copy
import sys

import torch

from ensemble_core.bench.runner import BenchOptions, run_bench
from ensemble_core.decoding.members import Member
from ensemble_core.ensemble import resolve_members
from ensemble_core.models.quantize import quantize_int8

torch.set_num_threads(int(sys.argv[1]))
small, qwen = resolve_members(["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
model = copy.deepcopy(qwen.model)
quantize_int8(model)
int8 = Member(model, qwen.tokenizer, name="qwen-int8")
options = BenchOptions(dataset=sys.argv[2], limit=int(sys.argv[3]), max_new_tokens=int(sys.argv[4]),
                       methods=("single", "safe"), members=(small.name, qwen.name, int8.name), safe_drafters=(0,),
                       subsets=((0, 1), (0, 2)), threads=int(sys.argv[1]), microbench=False, out=sys.argv[5],
                       plots=False)
run_bench(options, members=[small, qwen, int8])
