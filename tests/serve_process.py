"""A real ``offload serve`` process on 127.0.0.1 and a free port, for the server tests and
``bench.serve``: started with ``python -m offload.cli serve``, ready once ``/health`` is 200,
stopped with Ctrl-C (SIGINT)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model, flags: list[str], *, log=subprocess.DEVNULL, start_s: float = 600,
                 passive: bool = True):
        """``log``: where the server's stdout and stderr go. Waits up to ``start_s`` for
        ``/health`` (a cold Numba cache compiles the kernels first: minutes on 2 cores).
        ``passive``: OpenMP threads sleep between parallel regions (tests share the box with
        other tests); a benchmark leaves OpenMP's default, as a user runs it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        model = [str(model)] if model is not None else []      # None: the --placement plan names it
        self.proc = subprocess.Popen([sys.executable, "-m", "offload.cli", "serve", *model, "--host", "127.0.0.1",
                                      "--port", str(self.port), *flags],
                                     cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"offload serve exited with status {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"offload serve was not healthy after {start_s:.0f} s")
            time.sleep(0.1)

    def close(self) -> int:
        """Ctrl-C, then the exit status (uvicorn shuts down, then re-raises SIGINT: 130)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def serve_with_plan(tmp: Path, model: Path, flags: list[str], *, plan_flags: tuple[str, ...] = (),
                    n_max: int = 2):
    """A generator for a module fixture: ``offload plan`` of ``model`` on the CPU (with
    ``plan_flags``), its speculative n_max set as ``offload tune`` writes it, then ``offload
    serve --placement`` that plan with ``flags``; yields the server's URL and checks that
    Ctrl-C stops it cleanly. The server's output goes to ``tmp/server.log``, shown if it
    does not start."""
    import contextlib
    import io

    import pytest
    import yaml

    from offload.cli import main as cli_main

    plan = tmp / "plan.yaml"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["plan", str(model), "--devices", "CPU=16GiB", *plan_flags, "-o", str(plan)]) == 0
    doc = yaml.safe_load(plan.read_text())
    doc["speculative"]["n_max"] = n_max
    plan.write_text(yaml.safe_dump(doc))
    with open(tmp / "server.log", "w+") as log:
        try:
            proc = ServeProcess(None, ["--placement", str(plan), *flags], log=log)
        except RuntimeError as exc:
            log.seek(0)
            pytest.fail(f"{exc}:\n{log.read()}")
        yield proc.url
        assert proc.close() in (0, 130)
