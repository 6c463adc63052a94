"""Phase timers of the blend path (``time_phases: true`` in the connector's extra config).

The blender calls ``timer.lap(name)`` after each phase; with timing off the timer is
:data:`NO_TIMER`, whose methods do nothing (one method call per phase, a few per layer).
"""

from __future__ import annotations

import time


class PhaseTimer:
    """Wall-clock seconds per phase, summed over the phases' laps since :meth:`start`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._last = time.perf_counter()

    def start(self) -> None:
        """Forget earlier totals and start timing from now."""
        self.totals = {}
        self._last = time.perf_counter()

    def mark(self) -> None:
        """Start the next lap now (time since the last lap is not counted)."""
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Add the time since the last lap (or mark) to ``name``."""
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + (now - self._last)
        self._last = now

    def milliseconds(self) -> dict[str, float]:
        return {name: round(1000.0 * s, 3) for name, s in self.totals.items()}


class _NoTimer:
    """Timing off: every call does nothing."""

    totals: dict[str, float] = {}

    def start(self) -> None:
        pass

    def mark(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def milliseconds(self) -> dict[str, float]:
        return {}


NO_TIMER = _NoTimer()
