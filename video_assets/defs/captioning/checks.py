"""Asset checks of the captions table."""

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from video_assets.core.tables import CAPTIONS, SCHEMAS
from video_assets.core.vocabulary import CAPTION_OK
from video_assets.defs.captioning.assets import captions
from video_assets.defs.common import table_checks


@asset_check(asset=captions, description="Every ok caption has prose (an empty answer must be an error row).")
def captions_ok_rows_have_prose(tables: DeltaTables) -> AssetCheckResult:
    df = tables.read(CAPTIONS, SCHEMAS[CAPTIONS])
    empty = df.filter((pl.col("status") == CAPTION_OK) & (pl.col("prose").fill_null("").str.len_chars() == 0))
    return AssetCheckResult(
        passed=empty.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={"rows": df.height, "ok_rows_without_prose": empty.height},
    )


captioning_checks = [table_checks(CAPTIONS), captions_ok_rows_have_prose]
