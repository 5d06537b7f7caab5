"""Asset checks of the routed tables: their keys and columns (generated), and that every routed row
describes a caption that still exists."""

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, AssetKey, asset_check

from resources.delta import DeltaTables
from video_assets.core.structuring.versions import legacy_rows, rows_without_caption
from video_assets.core.tables import ALERTS, CAPTIONS, REVIEW_QUEUE
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks


def _follows_captions(table: str):
    key = AssetKey(table)

    @asset_check(
        asset=key,
        name=f"{table}_follow_captions",
        blocking=True,
        description=f"Every {table} row of the batch was routed from a caption that still exists (its digest): "
        "none points at a caption a recaption or a new split replaced.",
    )
    def _check(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
        batches = checked_batches(context, table, key)
        rows = read_checked(tables, table, batches)
        orphans = rows_without_caption(rows, read_checked(tables, CAPTIONS, batches))
        return AssetCheckResult(
            passed=orphans.is_empty(),
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **check_scope(batches),
                "rows": rows.height,
                "rows_without_caption": orphans.height,
                "rows_without_digest": legacy_rows(rows),
                "orphan_examples": orphans.head(10).select("video_id", "segment", "use_case").rows(),
            },
        )

    return _check


routing_checks = [
    table_checks(ALERTS),
    table_checks(REVIEW_QUEUE),
    _follows_captions(ALERTS),
    _follows_captions(REVIEW_QUEUE),
]
