"""TOML files of ``[[<kind>]]`` tables validated one by one (cameras, webhook destinations). Pure."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, ValidationError

from video_assets.core.validation import reasons


def load_entries(path: str | Path, kind: str, model: type[BaseModel]) -> list:
    """The ``[[kind]]`` tables of ``path`` as ``model`` instances; a ValueError naming the file and the entry
    (its ``name``, else its position) for anything wrong: not TOML, other keys, a bad field, a name twice."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.__class__.__name__})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML: {exc}") from exc
    unknown = sorted(set(data) - {kind})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; entries are [[{kind}]] tables")
    entries = data.get(kind) or []
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: no [[{kind}]] table")
    out, seen = [], set()
    for i, entry in enumerate(entries, start=1):
        label = entry.get("name") if isinstance(entry, dict) and isinstance(entry.get("name"), str) else f"#{i}"
        label = re.sub(r"[^A-Za-z0-9_.#-]", "?", label)[:64]
        try:
            item = model.model_validate(entry)
        except ValidationError as exc:
            raise ValueError(f"{path}: {kind} {label!r}: {reasons(exc, whole='entry')}") from None
        if item.name in seen:
            raise ValueError(f"{path}: {kind} {label!r}: the name is used twice")
        seen.add(item.name)
        out.append(item)
    return out
