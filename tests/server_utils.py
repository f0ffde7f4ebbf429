"""A real ``python -m ensemble_core.server`` process for the server tests.

The server binds ``--port 0`` (a free port chosen by the kernel, no race) and prints its
address; :meth:`ServerProcess.start` reads it from the log, then polls ``/health`` (bounded)
until it answers 200. :meth:`ServerProcess.stop` ends exactly that process (terminate,
then kill). Output goes to a log file that tests can read (``log_text``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

ADDRESS = re.compile(r"on (http://[^\s/]+)/v1")


class ServerProcess:
    def __init__(self, args: Sequence[str], log_path: Path, threads: int = 1) -> None:
        self.args, self.log_path, self.threads = list(args), Path(log_path), threads
        self.proc: subprocess.Popen[bytes] | None = None
        self.root = ""
        #: /health bodies seen while the server was loading (503s), for the loading-state checks.
        self.loading_answers: list[dict[str, Any]] = []
        self.startup_seconds = 0.0

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def _fail(self, why: str) -> None:
        tail = "\n".join(self.log_text().splitlines()[-40:])
        self.stop()
        raise RuntimeError(f"{why}\n--- server log (tail) ---\n{tail}")

    def start(self, timeout: float = 240.0) -> ServerProcess:
        env = {**os.environ, "ENSEMBLE_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ensemble_core.server", "--port", "0", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         cwd=Path(__file__).resolve().parents[1])
        deadline = t0 + timeout
        while not self.root:
            if self.proc.poll() is not None:
                self._fail(f"the server exited with status {self.proc.returncode} before binding")
            if time.monotonic() > deadline:
                self._fail("the server printed no address in time")
            match = ADDRESS.search(self.log_text())
            if match:
                self.root = match.group(1)
            else:
                time.sleep(0.2)
        while True:
            if self.proc.poll() is not None:
                self._fail(f"the server exited with status {self.proc.returncode} while loading")
            if time.monotonic() > deadline:
                self._fail(f"/health did not answer 200 within {timeout} s")
            try:
                r = httpx.get(self.root + "/health", timeout=5.0)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code == 200:
                break
            self.loading_answers.append({"status": r.status_code, **r.json()})
            time.sleep(0.3)
        self.startup_seconds = time.monotonic() - t0
        return self

    def health(self) -> dict[str, Any]:
        r = httpx.get(self.root + "/health", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def stop(self) -> int | None:
        """Terminate the process this object started (then kill it if it does not stop)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=15)


def sse_events(lines: Iterator[str] | Sequence[str]) -> list[Any]:
    """``data:`` payloads of an event stream, parsed; ``"[DONE]"`` kept as the string."""
    out: list[Any] = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]
