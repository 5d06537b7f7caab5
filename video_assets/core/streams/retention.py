"""Which stream segments retention deletes. Pure.

A segment older than ``days`` (by its wall-clock end) goes, unless it is evidence: a video with an alert or
a review label keeps its file until a person releases it (``released_at``) or neither exists any more.
Already-deleted segments are not listed again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta


def expired(
    segments: Iterable[Mapping], now: datetime, days: float, evidence_uris: set[str]
) -> tuple[list[Mapping], list[Mapping]]:
    """(to delete, kept as evidence) among the segments older than ``days``."""
    if days <= 0:
        raise ValueError("retention days must be > 0")
    cutoff = now - timedelta(days=days)
    old = [s for s in segments if s.get("deleted_at") is None and s["ended_at"] < cutoff]
    held = [s for s in old if s["uri"] in evidence_uris and s.get("released_at") is None]
    return [s for s in old if s not in held], held
