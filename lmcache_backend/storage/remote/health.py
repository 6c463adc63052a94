"""Outage tracking for a remote service: one warning per outage, background reconnection.

While the service is down, requests skip it at once (no network call, no waiting); a daemon thread
probes it with exponential backoff and reopens it when a probe succeeds. So a request waits on a
dead server at most once per outage, for one socket timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lmcache_backend.logtext import shorten

logger = logging.getLogger(__name__)


class ConnectionGuard:
    """Up/down state of one remote service.

    Args:
        name: how the service is named in logs (e.g. ``"redis://127.0.0.1:6379"``).
        probe: raises when the service is unreachable (e.g. a PING).
        base_delay: seconds before the first reconnection attempt.
        max_delay: cap of the doubling delay between attempts.
    """

    def __init__(
        self,
        name: str,
        probe: Callable[[], object],
        base_delay: float = 0.5,
        max_delay: float = 30.0,
    ) -> None:
        self.name = name
        self._probe = probe
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None
        self.outages = 0  # number of outages seen, for stats and tests
        self.reconnects = 0  # outages that ended: the service answered again

    @property
    def available(self) -> bool:
        """Whether requests should use the service now."""
        return self._down_since is None

    def failed(self, exc: BaseException) -> None:
        """Record a failed request; the first failure of an outage warns and starts probing."""
        with self._lock:
            if self._down_since is not None or self._stop.is_set():
                return
            self._down_since = time.monotonic()
            self.outages += 1
            self._prober = threading.Thread(
                target=self._reconnect_loop, name="lmcache-remote-reconnect", daemon=True
            )
            self._prober.start()
        logger.warning(
            "remote store %s unreachable (%s: %s); using local tiers only until it is back, "
            "retrying in the background",
            self.name,
            type(exc).__name__,
            shorten(str(exc)),
        )

    def _reconnect_loop(self) -> None:
        delay = self.base_delay
        while not self._stop.wait(delay):
            try:
                self._probe()
            except Exception:
                delay = min(delay * 2, self.max_delay)
                continue
            with self._lock:
                since = self._down_since
                self._down_since = None
                self.reconnects += 1
            logger.info(
                "remote store %s reachable again after %.1f s",
                self.name,
                time.monotonic() - (since or time.monotonic()),
            )
            return

    def close(self) -> None:
        """Stop the background prober (if any)."""
        self._stop.set()
        prober = self._prober
        if prober is not None and prober is not threading.current_thread():
            prober.join(timeout=1.0)
