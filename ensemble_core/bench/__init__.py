"""The benchmark harness behind ``ensemble bench`` (a package: one module per part).

Every method runs on the same questions, *interleaved* per question in one process
(question 1: every method, question 2: every method, ...), so that machine load, caches
and thermal state affect all methods alike and the latency ratios are fair.

Rows (one per method setting):

* ``single[<member>]``: each member alone with Hugging Face ``model.generate`` (greedy,
  KV cache): the speed limit every ensemble is measured against;
* ``every-token[<distribution>]``: UniTE (and GaC on request) at every token;
* ``safe[drafter=<member>]``: SAFE with each member as drafter;
* ``specem``, ``generate-then-select``.

A method whose module cannot be imported, or whose construction fails, is reported as
*skipped* with the reason (summary.md / summary.json), never dropped silently. A method
that raises on one question gets an ``error`` record for that question.

Outputs in the results folder: ``results.jsonl`` (one record per method and question),
``summary.json``, ``summary.md`` (table, skipped methods, issue targets met / missed) and
PNG plots (``latency_per_method.png``, ``latency_vs_length.png``, ``et_distribution.png``).

Modules: :mod:`.runner` (options, runners, rows, the interleaved driver), :mod:`.records`
(per-question records and per-method summaries), :mod:`.targets` (the issues' targets,
declared as data in ``targets.json`` and evaluated against a summary), :mod:`.intervals`
(a ratio's bootstrap interval over the questions), :mod:`.report`
(markdown and plots), :mod:`.microbench` (verify-in-line vs separate scoring).
"""

from ensemble_core.bench.microbench import verify_microbench
from ensemble_core.bench.records import (
    RESULTS_FILE,
    Row,
    RunOutput,
    ensemble_ratio,
    error_record,
    is_corrupted,
    make_record,
    summarize_rows,
)
from ensemble_core.bench.report import hardware, write_markdown, write_plots
from ensemble_core.bench.runner import (
    ALL_METHODS,
    BenchOptions,
    EnsembleRunner,
    HFSingleRunner,
    _TextStop,
    build_rows,
    check_available,
    cut_at_stop,
    run_bench,
)
from ensemble_core.bench.targets import TARGETS_FILE, Target, evaluate_targets, load_targets

__all__ = [
    "ALL_METHODS", "RESULTS_FILE", "TARGETS_FILE", "BenchOptions", "EnsembleRunner", "HFSingleRunner", "Row",
    "RunOutput", "Target", "_TextStop", "build_rows", "check_available", "cut_at_stop", "ensemble_ratio",
    "error_record", "evaluate_targets", "hardware", "is_corrupted", "load_targets", "make_record", "run_bench",
    "summarize_rows", "verify_microbench", "write_markdown", "write_plots",
]
