"""Asset checks of the embedding tables."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from video_assets.core.tables import FRAME_EMBEDDINGS, TEXT_EMBEDDINGS
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks
from video_assets.defs.embeddings.assets import frame_embeddings, text_embeddings


def _vectors_check(asset, table: str):
    @asset_check(
        asset=asset,
        name=f"{table}_vectors_whole",
        description="Every vector of the batch just embedded has its declared length, one length per encoder "
        "version, and a unit norm (Delta has no fixed-size array type: this check is the guarantee).",
    )
    def _check(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
        batches = checked_batches(context, table, asset.key)
        df = read_checked(tables, table, batches).filter(pl.col("embedding").is_not_null())
        df = df.with_columns(
            n=pl.col("embedding").list.len(),
            norm=pl.col("embedding").list.eval(pl.element().pow(2)).list.sum().sqrt(),
        )
        wrong_len = df.filter(pl.col("n") != pl.col("dim")).height
        dims = df.group_by("encoder_version").agg(pl.col("dim").n_unique().alias("dims"))
        mixed = dims.filter(pl.col("dims") > 1).height
        off_norm = df.filter((pl.col("norm") - 1.0).abs() > 1e-3).height
        return AssetCheckResult(
            passed=not (wrong_len or mixed or off_norm),
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **check_scope(batches),
                "vectors": df.height,
                "wrong_length": wrong_len,
                "versions_with_mixed_dims": mixed,
                "not_unit_norm": off_norm,
            },
        )

    return _check


embedding_checks = [
    table_checks(FRAME_EMBEDDINGS),
    table_checks(TEXT_EMBEDDINGS),
    _vectors_check(frame_embeddings, FRAME_EMBEDDINGS),
    _vectors_check(text_embeddings, TEXT_EMBEDDINGS),
]
