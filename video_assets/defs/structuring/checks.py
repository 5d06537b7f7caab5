"""Asset checks of the structured_events table."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from video_assets.core.tables import CAPTIONS, KEYS, STRUCTURED_EVENTS
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks
from video_assets.defs.structuring.assets import structured_events


def missing_structured_rows(caps: pl.DataFrame, events: pl.DataFrame) -> pl.DataFrame:
    """Caption keys without a structured row, for every (batch, caption versions, use case,
    structuring version) that has been structured at all: a caption silently dropped shows here."""
    runs = events.select(
        "batch_key", "model_version", "prompt_version", "use_case", "use_case_version", "structurer"
    ).unique()
    expected = runs.join(
        caps.select("video_id", "segment", "batch_key", "model_version", "prompt_version"),
        on=["batch_key", "model_version", "prompt_version"],
    )
    return expected.join(events, on=KEYS[STRUCTURED_EVENTS], how="anti")


@asset_check(
    asset=structured_events,
    description="Every caption of the batch just structured has a structured row (parsed, retried, "
    "unparsed or no_caption) for every use case the batch was structured for: nothing missing.",
)
def structured_events_cover_captions(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    batches = checked_batches(context, STRUCTURED_EVENTS, structured_events.key)
    events = read_checked(tables, STRUCTURED_EVENTS, batches)
    # Expected rows are per batch (missing_structured_rows joins on batch_key): the batch's captions suffice.
    missing = missing_structured_rows(read_checked(tables, CAPTIONS, batches), events)
    statuses = dict(events.group_by("status").len().sort("status").iter_rows())
    return AssetCheckResult(
        passed=missing.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            **check_scope(batches),
            "rows": events.height,
            "missing_rows": missing.height,
            "status_counts": statuses,
            "missing_examples": missing.head(10).select("video_id", "segment", "use_case").rows(),
        },
    )


structuring_checks = [table_checks(STRUCTURED_EVENTS), structured_events_cover_captions]
