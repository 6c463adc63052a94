"""``lmcache-backend serve`` as a child process for clients that drive it over HTTP (the demo,
the client and load benchmarks, the server tests): start on a free loopback port, wait for
health, read ``/metrics`` and the connector's stats file, stop the whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lmcache_backend.settings.writer import STARTED_ENGINE, Variables, child_env


class ServerExited(RuntimeError):
    """The server stopped before it answered; ``returncode`` is its exit status (2: ``serve``
    refused its arguments or configuration, the log's last line says why)."""

    def __init__(self, returncode: int, log_tail: str) -> None:
        super().__init__(f"server exited with {returncode}:\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``lmcache-backend serve`` as a child process on a loopback port; every wait is bounded.

    Args:
        vllm_args: further ``vllm serve`` options (e.g. ``["--enforce-eager"]``).
        variables: settings and variables of the server, typed (``{"remote_url": url}``); its
            engine blends unless they say otherwise.
        env: further variables by name, as a user gives them (``--server-env KEY=VALUE``),
            applied last.
        stats_file: the connector's JSON-lines file of blended requests.
        log_path: where the server's output goes (default: a temporary file).
        model: model folder (default: the embedded SmolLM2 model).
    """

    def __init__(
        self,
        vllm_args: list[str] | tuple[str, ...] = (),
        *,
        variables: Variables | None = None,
        env: Mapping[str, str] | None = None,
        stats_file: str | Path | None = None,
        log_path: str | Path | None = None,
        model: str | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.stats_file = Path(stats_file) if stats_file else None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="lmcache-backend-serve-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "lmcache_backend", "serve"]
        if model:
            cmd.append(model)
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *vllm_args]
        if self.stats_file:
            cmd += ["--stats-file", str(self.stats_file)]
        self.cmd = cmd
        # the server's environment: this process's, with the defaults of an engine this package
        # starts where it leaves them unset (a small KV cache on a CPU instead of a share of all
        # memory), blending on, then the caller's
        given: Variables = {"enable_blending": True, **(variables or {})}
        defaults: Variables = {**STARTED_ENGINE, "omp_num_threads": os.cpu_count() or 1}
        self.env = child_env(defaults=defaults, **given)
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Start the server and wait until ``/health`` answers (at most ``timeout_s``).

        Raises:
            ServerExited: the server exited (with its last log lines).
            RuntimeError: it did not answer in time (with its last log lines).
        """
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes to it until stop()
        # A session of its own: stop() ends the server and the engine processes it started.
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerExited(self.proc.returncode, self.log_tail())
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> str:
        """The server's Prometheus metrics (``/metrics``)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def stats(self, left_to_vllm: bool = False) -> list[dict]:
        """The connector's records of blended requests so far (``left_to_vllm``: also the
        lines of the requests it left to vLLM, ``"blended": false``)."""
        if not self.stats_file or not self.stats_file.exists():
            return []
        lines = [json.loads(line) for line in self.stats_file.read_text().splitlines() if line]
        return lines if left_to_vllm else [r for r in lines if r.get("blended", True)]

    def client(self, timeout_s: float = 120.0) -> Any:
        from openai import OpenAI

        return OpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", timeout=timeout_s, max_retries=0
        )

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def metric_totals(metrics_text: str, names: Iterable[str], **labels: str) -> dict[str, float]:
    """For each name, the sum of the Prometheus samples of that name (``name_total`` for a
    counter, as exposed) over their labels, or over the samples carrying every label given
    (``reason="opted out"``); 0 for a name with no sample. Parsed by ``prometheus_client``,
    the library vLLM serves ``/metrics`` with."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals and all(sample.labels.get(k) == v for k, v in labels.items()):
                totals[sample.name] += sample.value
    return totals


def metric_total(metrics_text: str, name: str, **labels: str) -> float:
    """One metric of :func:`metric_totals` (``vllm:num_preemptions_total``)."""
    return metric_totals(metrics_text, [name], **labels)[name]
