"""An OpenAI-compatible HTTP server for an ensemble (``ensemble serve``; docs/serving.md).

``create_app`` (FastAPI) is imported lazily, so that importing this package, or the
``ensemble`` command, needs neither FastAPI nor uvicorn (the ``serve`` extra).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_MAX_BODY_BYTES", "add_serve_parser", "cmd_serve", "create_app"]

from ensemble_core.server.protocol import DEFAULT_MAX_BODY_BYTES


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from ensemble_core.server.app import create_app

        return create_app
    if name in ("add_serve_parser", "cmd_serve"):
        from ensemble_core.server import cli

        return getattr(cli, name)
    raise AttributeError(name)
