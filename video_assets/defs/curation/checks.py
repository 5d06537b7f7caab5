"""Asset checks of the frames table."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from video_assets.core.tables import CURATED_FRAMES
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks
from video_assets.defs.curation.assets import frames


@asset_check(
    asset=frames,
    name="frames_kept_have_images",
    description="Every kept frame of the batch just curated has its image (bytes or a file path), and no "
    "dropped frame has one.",
)
def frames_kept_have_images(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    batches = checked_batches(context, CURATED_FRAMES, frames.key)
    df = read_checked(tables, CURATED_FRAMES, batches)
    has_image = pl.col("image").is_not_null() | pl.col("image_uri").is_not_null()
    kept_without = df.filter(pl.col("kept") & ~has_image).height
    dropped_with = df.filter(~pl.col("kept") & has_image).height
    return AssetCheckResult(
        passed=not (kept_without or dropped_with),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            **check_scope(batches),
            "rows": df.height,
            "kept_without_image": kept_without,
            "dropped_with_image": dropped_with,
        },
    )


curation_checks = [table_checks(CURATED_FRAMES), frames_kept_have_images]
