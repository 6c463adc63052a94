"""The server a client benchmark talks to: a running one (``--url``) or ``lmcache-backend serve``
started for the run."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def bench_server(
    url: str | None,
    stats_file: str | Path | None,
    vllm_args: list[str],
    env: dict[str, str],
    out: Any,
    prefix: str,
) -> Iterator[tuple[str, Path | None, Any]]:
    """Yield ``(base_url, stats_file or None, server or None)``.

    With ``url``: that server and ``stats_file`` as given. Otherwise ``lmcache-backend serve``
    with ``vllm_args`` and ``env`` on a free loopback port, its stats file (``stats_file``, or one
    in a temporary folder) and log in that folder; on an error its last log lines are printed to
    ``out``; it is stopped and the folder removed at the end.
    """
    from lmcache_backend.integration.vllm.serving.process import ServerProcess

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if url:
            yield url.rstrip("/"), Path(stats_file) if stats_file else None, None
            return
        server = ServerProcess(
            vllm_args,
            env=env,
            stats_file=Path(stats_file) if stats_file else Path(tmp) / "blend.jsonl",
            log_path=Path(tmp) / "server.log",
        )
        print(f"starting lmcache-backend serve on {server.base_url} ...", file=out, flush=True)
        try:
            server.start(timeout_s=600)
            yield server.base_url, server.stats_file, server
        except Exception:
            print(f"server log (last lines):\n{server.log_tail()}", file=out)
            raise
        finally:
            server.stop()
