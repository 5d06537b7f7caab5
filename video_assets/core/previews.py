"""Markdown previews of table rows (materialisation metadata, MLflow artifacts)."""

from __future__ import annotations

from typing import Any

import polars as pl

PREVIEW_ROWS = 8
CELL_CHARS = 40


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    text = text.replace("|", "\\|").replace("\n", " ")
    if len(text) <= CELL_CHARS:
        return text
    if "/" in text:  # paths and URIs: the file name is the informative end
        return "…" + text[-(CELL_CHARS - 1) :]
    return text[: CELL_CHARS - 1] + "…"


def markdown_table(df: pl.DataFrame, columns: list[str] | None = None, rows: int = PREVIEW_ROWS) -> str:
    cols = [c for c in (columns or df.columns) if c in df.columns]
    if df.is_empty():
        return "_no rows_"
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.select(cols).head(rows).iter_rows():
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    if df.height > rows:
        lines.append(f"\n_{df.height - rows} more rows_")
    return "\n".join(lines)
