"""``ensemble serve``: serve one ensemble over an OpenAI-compatible HTTP API.

``ensemble_core.cli`` adds the subcommand with :func:`add_serve_parser` and runs
:func:`cmd_serve`; ``python -m ensemble_core.server`` takes the same flags directly. The
socket is bound first (``--port 0`` picks a free port; the address is printed), then the
members load in a background thread while ``/health`` answers 503. A load that fails
stops the server with exit status 1.

``tiny:ALIAS[:SEED]`` members are random-weight models shaped like a bundled alias with its
real tokenizer (:func:`ensemble_core.testing.tiny_member`): a testing aid that starts in
seconds. Their text is gibberish, but deterministic (greedy) and exercising every code path.

FastAPI and uvicorn are imported only when the command runs (``pip install tokensemble[serve]``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ensemble_core.decoding.members import Member
from ensemble_core.errors import EnsembleError, InvalidOptionError, MissingDependencyError

#: Options of tiny members that make them write varied text (default random init repeats one token).
TINY_OPTIONS: dict[str, Any] = {"initializer_range": 0.2, "tie_word_embeddings": False}
THREADS_ENV = "ENSEMBLE_THREADS"


def tcp_port(text: str) -> int:
    """argparse type of ``--port``: a TCP port number, 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: give a whole number from 1 to 65535 "
                                         "(or 0 for any free port)")
    return value


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``serve`` flags to ``p`` (used by ``ensemble serve`` and ``python -m ensemble_core.server``)."""
    from ensemble_core.ensemble import DEFAULT_MEMBERS
    from ensemble_core.flags import add_load_flags
    from ensemble_core.methods import METHODS
    from ensemble_core.server.protocol import DEFAULT_MAX_BODY_BYTES

    p.add_argument("--members", nargs="+", metavar="MEMBER", default=None,
                   help="aliases, local directories, .gguf files or Hugging Face ids "
                        f"(default: {' '.join(DEFAULT_MEMBERS)}); tiny:ALIAS[:SEED] = random-weight test member")
    add_load_flags(p)
    p.add_argument("--method", default="safe", choices=sorted(METHODS))
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="method config default, e.g. --set lookahead=3 --set max_new_tokens=128 (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=tcp_port, default=8000, help="TCP port (0: any free port; the address is printed)")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="extra names accepted in 'model' and listed by /v1/models")
    p.add_argument("--api-key", default=os.environ.get("ENSEMBLE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $ENSEMBLE_API_KEY; none: open)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--timeout", type=float, default=None, help="seconds one generation may take (default: no limit)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads (default ${THREADS_ENV} or torch's choice)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    return p


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``ensemble`` command's subparsers."""
    p = subparsers.add_parser("serve", help="serve an ensemble over an OpenAI-compatible HTTP API",
                              description="Serve an ensemble over an OpenAI-compatible HTTP API (docs/serving.md).")
    configure_parser(p)
    p.set_defaults(func=cmd_serve)
    return p


def load_member(name: str, options: dict[str, Any]) -> Member:
    """One member: ``tiny:ALIAS[:SEED]`` or anything :func:`ensemble_core.resolve_members` accepts."""
    from ensemble_core.ensemble import resolve_members

    if name.startswith("tiny:"):
        from ensemble_core.testing import tiny_member

        alias, _, seed = name[len("tiny:"):].partition(":")
        if seed and not seed.isdigit():
            raise InvalidOptionError("--members", name, "tiny:ALIAS or tiny:ALIAS:SEED with an integer seed")
        return tiny_member(alias, int(seed or 0), **TINY_OPTIONS)
    return resolve_members([name], **options)[0]


def method_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--set`` values, checked against the method's config before anything loads."""
    from ensemble_core.flags import parse_sets
    from ensemble_core.methods import method_class

    sets = parse_sets(args.set)
    extra = [k for k in sets if k != "*"]
    if extra:
        raise InvalidOptionError("--set", extra, "plain key=value (no method prefix)")
    config = dict(sets.get("*", {}))
    method_class(args.method).config_class().replace(**config)
    return config


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """Bind, load in the background, serve until interrupted; 1 if loading failed.

    On SIGINT / SIGTERM the running generations end first (each answers with what it has,
    ``finish_reason: "cancelled"``: :meth:`~ensemble_core.server.engine.Engine.stop_all`), then uvicorn
    stops and, as uvicorn does, re-raises the signal (exit status 130 / 143 from a shell).
    """
    try:
        import uvicorn

        from ensemble_core.server.app import create_app
    except ImportError as exc:
        raise MissingDependencyError(exc.name or "fastapi", "ensemble serve", "pip install 'tokensemble[serve]'") from exc
    import torch

    from ensemble_core.ensemble import DEFAULT_MEMBERS, Ensemble
    from ensemble_core.flags import member_options

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = args.threads if args.threads is not None else int(os.environ.get(THREADS_ENV, "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if args.max_body_bytes < 1:
        raise InvalidOptionError("--max-body-bytes", args.max_body_bytes, "a positive number of bytes")
    if args.timeout is not None and not args.timeout > 0:
        raise InvalidOptionError("--timeout", args.timeout, "a positive number of seconds")
    config = method_config(args)
    names = list(args.members or DEFAULT_MEMBERS)
    per_member = member_options(args, len(names))

    def build() -> Ensemble:
        return Ensemble([load_member(n, o) for n, o in zip(names, per_member)], method=args.method, **config)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ensemble_core").setLevel(args.log_level.upper())
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if args.api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("ensemble_core.server").warning(
            "Listening on %s without --api-key: anyone who can reach this address can use the server.", host)
    app = create_app(load=build, served_model_names=args.served_model_name, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, timeout=args.timeout)
    state = app.state.loading

    class Server(uvicorn.Server):
        """uvicorn's server, ending the live generations when a stop signal arrives: its graceful shutdown
        then finds them answered instead of cutting them when ``timeout_graceful_shutdown`` ends."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if state.engine is not None:
                state.engine.stop_all()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                                   timeout_graceful_shutdown=5))

    def stop_if_load_fails() -> None:
        state.done.wait()
        if state.error is not None:
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, name="ensemble-load-watch", daemon=True).start()
    print(f"Serving {args.method} over {' + '.join(names)} on http://{shown}:{port}/v1 (loading in the background; "
          f"GET /health answers 200 when ready)", flush=True)
    server.run(sockets=[sock])
    return 1 if state.error is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ensemble_core.server``: the ``serve`` flags without the subcommand."""
    parser = configure_parser(argparse.ArgumentParser(prog="python -m ensemble_core.server",
                                                      description="Serve an ensemble over an OpenAI-compatible HTTP API."))
    args = parser.parse_args(argv)
    try:
        return cmd_serve(args)
    except EnsembleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
