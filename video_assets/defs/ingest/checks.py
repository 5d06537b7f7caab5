"""Asset checks of the ingest tables, over the batch just materialised (their cost is a batch's)."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, Config, asset_check
from pydantic import Field

from resources.delta import DeltaTables
from video_assets.core.tables import RAW_VIDEOS, VIDEO_METADATA
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks
from video_assets.defs.ingest.assets import video_metadata


class NotOkRatioConfig(Config):
    max_not_ok_ratio: float = Field(default=0.25, ge=0, le=1, description="Warn above this share of unusable files")


@asset_check(
    asset=video_metadata,
    description="Share of the batch's files that are not usable videos (ok=false); warns above max_not_ok_ratio.",
)
def video_metadata_not_ok_ratio(
    context: AssetCheckExecutionContext, config: NotOkRatioConfig, tables: DeltaTables
) -> AssetCheckResult:
    batches = checked_batches(context, VIDEO_METADATA, video_metadata.key)
    df = read_checked(tables, VIDEO_METADATA, batches)
    bad = df.filter(~pl.col("ok"))
    ratio = bad.height / df.height if df.height else 0.0
    return AssetCheckResult(
        passed=ratio <= config.max_not_ok_ratio,
        severity=AssetCheckSeverity.WARN,
        metadata={
            **check_scope(batches),
            "not_ok_ratio": ratio,
            "threshold": config.max_not_ok_ratio,
            "not_ok_files": bad.get_column("uri").head(20).to_list(),
        },
    )


ingest_checks = [table_checks(RAW_VIDEOS), table_checks(VIDEO_METADATA), video_metadata_not_ok_ratio]
