"""Kubernetes time: RFC 3339 stamps ("2026-01-02T03:04:05Z") to and from Python values."""
from __future__ import annotations

from datetime import UTC, datetime

MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # metav1.MicroTime (Lease renewTime, Events)


def parse(stamp: str | None) -> datetime | None:
    """A metav1.Time or MicroTime as an aware datetime; None for an absent stamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def epoch(stamp: str | None) -> float | None:
    when = parse(stamp)
    return when.timestamp() if when else None


def stamp(when: datetime | float) -> str:
    """A metav1.Time (whole seconds, UTC, "Z") from a datetime or epoch seconds."""
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when, UTC)
    return when.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def micro_stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime(MICRO_TIME)
