"""Asset checks of the ingest tables (whole table, not only the latest batch)."""

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, Config, asset_check
from pydantic import Field

from resources.delta import DeltaTables
from video_assets.core.tables import RAW_VIDEOS, SCHEMAS, VIDEO_METADATA
from video_assets.defs.common import table_checks
from video_assets.defs.ingest.assets import video_metadata


class NotOkRatioConfig(Config):
    max_not_ok_ratio: float = Field(default=0.25, ge=0, le=1, description="Warn above this share of unusable files")


@asset_check(
    asset=video_metadata,
    description="Share of files that are not usable videos (ok=false); warns above max_not_ok_ratio.",
)
def video_metadata_not_ok_ratio(config: NotOkRatioConfig, tables: DeltaTables) -> AssetCheckResult:
    df = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA])
    bad = df.filter(~pl.col("ok"))
    ratio = bad.height / df.height if df.height else 0.0
    return AssetCheckResult(
        passed=ratio <= config.max_not_ok_ratio,
        severity=AssetCheckSeverity.WARN,
        metadata={
            "not_ok_ratio": ratio,
            "threshold": config.max_not_ok_ratio,
            "not_ok_files": bad.get_column("uri").head(20).to_list(),
        },
    )


ingest_checks = [table_checks(RAW_VIDEOS), table_checks(VIDEO_METADATA), video_metadata_not_ok_ratio]
