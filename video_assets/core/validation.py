"""A pydantic ValidationError as one readable line: where and why, never the input echoed back. Pure."""

from __future__ import annotations

from pydantic import ValidationError


def reasons(exc: ValidationError, whole: str = "", limit: int | None = None) -> str:
    """``"field.sub: message; ..."`` for each error (at most ``limit``); ``whole`` names an error of the whole
    object (one with no location)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors()[:limit])
