"""Asset checks of the captions table."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import error_share, segment_counts
from video_assets.core.tables import CAPTIONS
from video_assets.core.vocabulary import CAPTION_OK
from video_assets.defs.captioning.assets import captions
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks


@asset_check(
    asset=captions,
    description="Every ok caption of the batch just captioned has prose (an empty answer must be an error row).",
)
def captions_ok_rows_have_prose(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    batches = checked_batches(context, CAPTIONS, captions.key)
    df = read_checked(tables, CAPTIONS, batches)
    empty = df.filter((pl.col("status") == CAPTION_OK) & (pl.col("prose").fill_null("").str.len_chars() == 0))
    return AssetCheckResult(
        passed=empty.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={**check_scope(batches), "rows": df.height, "ok_rows_without_prose": empty.height},
    )


@asset_check(
    asset=captions,
    description="Every video of the batch just captioned has a row for each segment its plan had (ok or error): "
    "none is half written.",
)
def captions_videos_complete(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    batches = checked_batches(context, CAPTIONS, captions.key)
    df = read_checked(tables, CAPTIONS, batches)
    per_video = segment_counts(df, by=("video_id", "model_version", "prompt_version"))
    partial = per_video.filter(pl.col("planned").is_not_null() & (pl.col("rows") != pl.col("planned")))
    return AssetCheckResult(
        passed=partial.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            **check_scope(batches),
            "videos": per_video.height,
            "incomplete_videos": partial.height,
            "examples": partial.head(5).select("video_id", "rows", "planned").to_dicts(),
        },
    )


@asset_check(
    asset=captions,
    blocking=True,
    description="Most segments of the batch were captioned: more than VLM_MAX_ERROR_SHARE of its segments as "
    "error rows (an engine or endpoint down, a wrong model) blocks the batch, so nothing is structured, routed "
    "or alerted from it and the run fails saying why. Files that could not be probed or decoded do not count.",
)
def captions_mostly_captioned(
    context: AssetCheckExecutionContext, tables: DeltaTables, vlm: VlmSettings
) -> AssetCheckResult:
    batches = checked_batches(context, CAPTIONS, captions.key)
    share = error_share(read_checked(tables, CAPTIONS, batches))
    passed = share["error_share"] <= vlm.max_error_share
    return AssetCheckResult(
        passed=passed,
        severity=AssetCheckSeverity.ERROR,
        description=None
        if passed
        else f"{share['errors']} of {share['segments']} segments are error rows (more than VLM_MAX_ERROR_SHARE="
        f"{vlm.max_error_share:g}); e.g. {share['reasons'][:2]}",
        metadata={**check_scope(batches), **share, "max_error_share": vlm.max_error_share},
    )


captioning_checks = [
    table_checks(CAPTIONS),
    captions_ok_rows_have_prose,
    captions_videos_complete,
    captions_mostly_captioned,
]
