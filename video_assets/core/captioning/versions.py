"""Which caption rows belong to one (captioning model, caption prompt) pair, and which videos it has
already captioned: one definition, used by the captions asset, structuring, routing, evaluation and
promotion. Pure polars."""

from __future__ import annotations

import polars as pl

from video_assets.core.vocabulary import CAPTION_OK


def caption_versions(model_version: str, prompt_version: int) -> pl.Expr:
    """Rows of one (captioning model, caption prompt) pair."""
    return (pl.col("model_version") == model_version) & (pl.col("prompt_version") == prompt_version)


def captioned_ok(captions_df: pl.DataFrame, model_version: str, prompt_version: int) -> list[str]:
    """Videos this model + prompt has already captioned successfully (a rerun skips them)."""
    ok = captions_df.filter(caption_versions(model_version, prompt_version) & (pl.col("status") == CAPTION_OK))
    return ok.get_column("video_id").unique().to_list()
