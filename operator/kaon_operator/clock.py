"""The one clock of the operator and the router, in one seam: the wall clock (condition and Event
stamps, the autoscaler's samples) and the monotonic one (intervals, retries, back-off, deadlines).
Pure code takes the time as an argument; only the edges read it, and they read it here."""
from __future__ import annotations

import time
from datetime import UTC, datetime


def now() -> datetime:
    """The wall clock, aware, in UTC."""
    return datetime.now(UTC)


def seconds() -> float:
    """The wall clock in seconds since the epoch."""
    return time.time()


def monotonic() -> float:
    """Seconds on a clock that never goes back: for intervals, never for stamps."""
    return time.monotonic()
