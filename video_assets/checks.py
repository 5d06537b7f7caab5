"""Asset checks guarding the ingest tables (whole table, not only the latest batch)."""


import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, AssetKey, Field, asset_check

from resources.delta import DeltaTables
from video_assets.captions import captions
from video_assets.events import structured_events
from video_assets.ingest import raw_videos, video_metadata
from video_assets.tables import (
    ALERTS,
    CAPTIONS,
    KEYS,
    RAW_VIDEOS,
    REVIEW_QUEUE,
    SCHEMAS,
    STRUCTURED_EVENTS,
    VIDEO_METADATA,
    required_columns,
)


def duplicate_ids(df: pl.DataFrame, keys: list[str] | None = None) -> list:
    """Key values present more than once (tuples for composite keys)."""
    keys = keys or ["video_id"]
    dups = df.group_by(keys).len().filter(pl.col("len") > 1)
    return [row[0] if len(keys) == 1 else list(row) for row in dups.select(keys).iter_rows()]


def null_counts(df: pl.DataFrame, columns: list[str]) -> dict[str, int]:
    return {c: n for c in columns if (n := int(df.get_column(c).null_count())) > 0}


def _unique(tables: DeltaTables, name: str) -> AssetCheckResult:
    df = tables.read(name, SCHEMAS[name])
    dups = duplicate_ids(df, KEYS[name])
    return AssetCheckResult(passed=not dups, metadata={"rows": df.height, "duplicate_keys": dups[:20]})


def _not_null(tables: DeltaTables, name: str) -> AssetCheckResult:
    df = tables.read(name, SCHEMAS[name])
    nulls = null_counts(df, required_columns(name))
    return AssetCheckResult(passed=not nulls, metadata={"rows": df.height, "null_counts": nulls})


@asset_check(asset=raw_videos, description="No video_id appears twice in the registry.")
def raw_videos_unique_id(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, RAW_VIDEOS)


@asset_check(asset=raw_videos, description="Required registry columns are never null.")
def raw_videos_required_columns(tables: DeltaTables) -> AssetCheckResult:
    return _not_null(tables, RAW_VIDEOS)


@asset_check(asset=video_metadata, description="One metadata row per video_id.")
def video_metadata_unique_id(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, VIDEO_METADATA)


@asset_check(asset=video_metadata, description="Required metadata columns are never null.")
def video_metadata_required_columns(tables: DeltaTables) -> AssetCheckResult:
    return _not_null(tables, VIDEO_METADATA)


@asset_check(
    asset=video_metadata,
    description="Share of files that are not usable videos (ok=false); warns above max_not_ok_ratio.",
    config_schema={"max_not_ok_ratio": Field(float, default_value=0.25, is_required=False)},
)
def video_metadata_not_ok_ratio(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    df = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA])
    threshold = context.op_execution_context.op_config["max_not_ok_ratio"]
    bad = df.filter(~pl.col("ok"))
    ratio = bad.height / df.height if df.height else 0.0
    return AssetCheckResult(
        passed=ratio <= threshold,
        severity=AssetCheckSeverity.WARN,
        metadata={
            "not_ok_ratio": ratio,
            "threshold": threshold,
            "not_ok_files": bad.get_column("uri").head(20).to_list(),
        },
    )


@asset_check(asset=captions, description="One row per (video_id, segment, model_version, prompt_version).")
def captions_unique_key(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, CAPTIONS)


@asset_check(asset=captions, description="Required caption columns are never null; ok rows have prose.")
def captions_required_columns(tables: DeltaTables) -> AssetCheckResult:
    df = tables.read(CAPTIONS, SCHEMAS[CAPTIONS])
    nulls = null_counts(df, required_columns(CAPTIONS))
    empty = df.filter((pl.col("status") == "ok") & (pl.col("prose").fill_null("").str.len_chars() == 0)).height
    return AssetCheckResult(passed=not nulls and empty == 0, metadata={"rows": df.height, "null_counts": nulls, "ok_rows_without_prose": empty})


ingest_checks = [
    raw_videos_unique_id,
    raw_videos_required_columns,
    video_metadata_unique_id,
    video_metadata_required_columns,
    video_metadata_not_ok_ratio,
]
caption_checks = [captions_unique_key, captions_required_columns]


@asset_check(asset=structured_events, description="One row per caption, use case and structuring version.")
def structured_events_unique_key(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, STRUCTURED_EVENTS)


def missing_structured_rows(caps: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """Caption keys without a structured row, for every (batch, caption versions, use case,
    structuring version) that has been structured at all: a caption silently dropped shows here."""
    runs = events.select("batch_key", "model_version", "prompt_version", "use_case", "use_case_version", "structurer").unique()
    expected = runs.join(caps.select("video_id", "segment", "batch_key", "model_version", "prompt_version"),
                         on=["batch_key", "model_version", "prompt_version"])
    return expected.join(events, on=KEYS[STRUCTURED_EVENTS], how="anti")


@asset_check(asset=structured_events, description="Every caption has a structured row (parsed, retried, "
             "unparsed or no_caption) for every use case its batch was structured for: nothing missing.")
def structured_events_cover_captions(tables: DeltaTables) -> AssetCheckResult:
    events = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS])
    missing = missing_structured_rows(tables.read(CAPTIONS, SCHEMAS[CAPTIONS]), events)
    statuses = dict(events.group_by("status").len().sort("status").iter_rows())
    return AssetCheckResult(
        passed=missing.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={"rows": events.height, "missing_rows": missing.height, "status_counts": statuses,
                  "missing_examples": missing.head(10).select("video_id", "segment", "use_case").rows()},
    )


@asset_check(asset=AssetKey("alerts"), description="One alert per structured row.")
def alerts_unique_key(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, ALERTS)


@asset_check(asset=AssetKey("review_queue"), description="One review item per structured row.")
def review_queue_unique_key(tables: DeltaTables) -> AssetCheckResult:
    return _unique(tables, REVIEW_QUEUE)


event_checks = [structured_events_unique_key, structured_events_cover_captions, alerts_unique_key, review_queue_unique_key]
