"""Bench rows run twice: as configured and with some options changed, interleaved on every question.

Why: a setting's cost is a ratio of two settings of the same method, and ratios are only fair when
both answer the same questions back to back (the machine's load changes by the minute). The bench
runs one setting per method; the scripts next to this one (``reliability/ab_bench.py``,
``defaults/levers_bench.py``) replace ``ensemble_core.bench.runner.build_rows`` with
:func:`with_variant` and run the ordinary interleaved driver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def with_variant(build_rows: Callable[[Any, Any], list[Any]], members: Any, options: Any, methods: Sequence[str],
                 overrides: Mapping[str, Mapping[str, Any]], suffix: str) -> list[Any]:
    """``build_rows(members, options)``, then the rows of ``methods`` again with ``overrides`` merged into
    their method config (``{"safe": {...}}``, or ``"*"`` for every method), labelled ``[...; suffix]``."""
    rows = build_rows(members, options)
    methods = tuple(m for m in methods if m in options.methods)
    if not methods:
        return rows
    config = {k: dict(v) for k, v in options.method_config.items()}
    for key, values in overrides.items():
        config[key] = {**config.get(key, {}), **values}
    extra = build_rows(members, dataclasses.replace(options, methods=methods, method_config=config))
    for row in extra:
        row.label = row.label[:-1] + f"; {suffix}]" if row.label.endswith("]") else f"{row.label}[{suffix}]"
    return rows + extra
