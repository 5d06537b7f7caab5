"""Which caption rows belong to one (captioning model, caption prompt) pair, and which videos it has
completely captioned: one definition, used by the captions asset, structuring, routing, evaluation and
promotion. Pure polars."""

from __future__ import annotations

import hashlib
import json

import polars as pl

from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.vocabulary import CAPTION_OK


def caption_versions(model_version: str, prompt_version: int) -> pl.Expr:
    """Rows of one (captioning model, caption prompt) pair."""
    return (pl.col("model_version") == model_version) & (pl.col("prompt_version") == prompt_version)


def split_key(sampling: SamplingConfig) -> str:
    """How a plan splits videos into segments: captions made under another split are not reused."""
    return f"segment_s={sampling.segment_s or 'none'};scene_split={str(sampling.scene_split).lower()}"


def _with_completeness_columns(df: pl.DataFrame) -> pl.DataFrame:
    # Tables written before these columns existed: no planned count (all rows ok is then complete).
    for name, dtype in (("segments", pl.Int32), ("split", pl.String)):
        if name not in df.columns:
            df = df.with_columns(pl.lit(None, dtype).alias(name))
    return df


def segment_counts(captions_df: pl.DataFrame, by: tuple[str, ...] = ("video_id",)) -> pl.DataFrame:
    """Per ``by`` group (a video, or a video under each model and prompt): distinct segment ``rows``,
    ``ok_segments``, ``planned`` segments and the ``split``."""
    return (
        _with_completeness_columns(captions_df)
        .group_by(*by)
        .agg(
            pl.col("segment").n_unique().alias("rows"),
            (pl.col("status") == CAPTION_OK).sum().alias("ok_segments"),
            pl.col("segments").max().alias("planned"),
            pl.col("split").first().alias("split"),
        )
    )


def video_completeness(captions_df: pl.DataFrame, model_version: str, prompt_version: int) -> pl.DataFrame:
    """One row per video this pair has rows for: ``ok_segments``, ``planned`` and ``complete`` (every
    planned segment present and ok; a video with any error row is not complete)."""
    per_video = segment_counts(captions_df.filter(caption_versions(model_version, prompt_version)))
    return per_video.with_columns(
        complete=(pl.col("ok_segments") == pl.col("rows"))
        & (pl.col("planned").is_null() | (pl.col("rows") == pl.col("planned")))
    )


def captioned_ok(
    captions_df: pl.DataFrame, model_version: str, prompt_version: int, split: str | None = None
) -> list[str]:
    """Videos this model + prompt has completely captioned (under ``split`` when given): a rerun skips
    them. A video with a missing or failed segment is not among them, so a rerun captions it again."""
    done = video_completeness(captions_df, model_version, prompt_version).filter(pl.col("complete"))
    if split is not None:
        done = done.filter(pl.col("split").is_null() | (pl.col("split") == split))
    return done.get_column("video_id").to_list()


def caption_source_version(model_version: str, prompt_version: int) -> str:
    """How rows derived from a caption name the caption pair they came from (``text_embeddings.source_version``)."""
    return f"{model_version}/{prompt_version}"


def caption_frames(caps: pl.DataFrame) -> list[dict]:
    """Per video of ``caps`` (one caption pair's rows), in first-seen order: its ids and the frame times
    each ok segment's caption saw (``times``: segment -> times; empty when no segment has frames, with
    ``reason`` saying why). What later stages decode again, so their frames are the captions' own."""
    out = []
    for (_,), rows in caps.group_by(["video_id"], maintain_order=True):
        ok = rows.filter((pl.col("status") == CAPTION_OK) & (pl.col("frame_timestamps").list.len() > 0))
        first = rows.row(0, named=True)
        times = {int(r["segment"]): list(r["frame_timestamps"]) for r in ok.iter_rows(named=True)}
        reason = None if times else f"no captioned frames: {first['error'] or first['status']}"
        out.append({k: first[k] for k in ("video_id", "batch_key", "uri")} | {"times": times, "reason": reason})
    return out


# What a row derived from a caption depends on: the caption's identity (video, segment, pair), how its
# video was split, its time window and what it says. A recaption that says the same over the same
# window keeps its digest (nothing downstream to redo); a new split or new prose changes it.
DIGEST_FIELDS = (
    "video_id",
    "segment",
    "model_version",
    "prompt_version",
    "split",
    "segment_start_s",
    "segment_end_s",
    "status",
    "prose",
)


def caption_digest(row: dict) -> str:
    """The digest of one caption row (a dict of the captions table): rows derived from it
    (``structured_events``, ``alerts``, ``review_queue``) carry it as ``caption_digest``, so a row whose
    caption was replaced or vanished is found by a join, not by a time stamp."""
    payload = json.dumps([row.get(k) for k in DIGEST_FIELDS], default=str, ensure_ascii=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def with_caption_digest(caps: pl.DataFrame) -> pl.DataFrame:
    """``caps`` with its rows' ``caption_digest`` column (as it is, when it has one already)."""
    if "caption_digest" in caps.columns:
        return caps
    digests = [caption_digest(r) for r in caps.iter_rows(named=True)]
    return caps.with_columns(caption_digest=pl.Series(digests, dtype=pl.String))


def error_share(captions_df: pl.DataFrame) -> dict:
    """How much of a batch's latest captioning (the model and prompt of its newest row) the engine failed:
    of the segments whose frames were sampled (sent to the engine), how many came back as error rows, their
    share (0 for none) and the commonest reasons. Files the probe rejected and videos the CPU stage could not
    decode are left out: the input's fault, not the engine's, and no frames were sampled for them."""
    if captions_df.is_empty():
        return {"segments": 0, "errors": 0, "error_share": 0.0, "reasons": []}
    latest = captions_df.sort("captioned_at").row(-1, named=True)
    rows = captions_df.filter(
        caption_versions(latest["model_version"], latest["prompt_version"])
        & (pl.col("frame_timestamps").list.len().fill_null(0) > 0)
    )
    errors = rows.filter(pl.col("status") != CAPTION_OK)
    reasons = errors.group_by("error").len().sort("len", descending=True).get_column("error").head(3).to_list()
    return {
        "segments": rows.height,
        "errors": errors.height,
        "error_share": errors.height / rows.height if rows.height else 0.0,
        "reasons": [str(r)[:200] for r in reasons],
    }
