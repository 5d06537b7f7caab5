"""Which structured_events rows belong to one caption pair and structuring model (and use case
version), and which captions are left to structure. Pure polars."""

from __future__ import annotations

import polars as pl

from video_assets.core.captioning.versions import caption_versions
from video_assets.core.structuring.usecase import UseCase


def structuring_versions(
    model_version: str, prompt_version: int, structurer: str, uc: UseCase | None = None
) -> pl.Expr:
    """structured_events rows of one caption pair and structuring model (and use case version, if given)."""
    expr = caption_versions(model_version, prompt_version) & (pl.col("structurer") == structurer)
    if uc is not None:
        expr = expr & (pl.col("use_case") == uc.name) & (pl.col("use_case_version") == uc.version)
    return expr


def pending_captions(caption_rows: list[dict], events: pl.DataFrame, uc: UseCase) -> list[dict]:
    """Caption rows without a row of the use case's current version in ``events`` (already filtered
    to the caption pair and structurer): what is left to structure."""
    done = events.filter((pl.col("use_case") == uc.name) & (pl.col("use_case_version") == uc.version))
    keys = set(zip(done.get_column("video_id").to_list(), done.get_column("segment").to_list()))
    return [c for c in caption_rows if (c["video_id"], c["segment"]) not in keys]
