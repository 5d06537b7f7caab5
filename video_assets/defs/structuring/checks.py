"""Asset checks of the structured_events table."""

import polars as pl
from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, asset_check

from resources.delta import DeltaTables
from video_assets.core.captioning.versions import caption_versions, with_caption_digest
from video_assets.core.structuring.versions import captions_without_rows, legacy_rows, rows_without_caption
from video_assets.core.tables import CAPTIONS, STRUCTURED_EVENTS
from video_assets.defs.common import check_scope, checked_batches, read_checked, table_checks
from video_assets.defs.lineage import upstream_metadata
from video_assets.defs.structuring.assets import structured_events


@asset_check(
    asset=structured_events,
    blocking=True,  # alerts, review_queue, eval_scores and the index of the same run wait for it
    description="The batch's structured rows follow its captions: every caption of the pair just "
    "structured has a row for each use case, made from that caption (its digest), and no structured row "
    "describes a caption that was replaced (a recaption, a new split) or is gone.",
)
def structured_events_follow_captions(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    batches = checked_batches(context, STRUCTURED_EVENTS, structured_events.key)
    events = read_checked(tables, STRUCTURED_EVENTS, batches)
    caps = with_caption_digest(read_checked(tables, CAPTIONS, batches))
    missing = []
    for batch in batches or sorted(set(events.get_column("batch_key").to_list())):
        run = upstream_metadata(context, STRUCTURED_EVENTS, batch) or {}  # what the step just structured
        if run.get("model_version") is None or not run.get("use_cases"):
            continue
        pair = caption_versions(str(run["model_version"]), int(run["prompt_version"]))
        batch_caps = caps.filter((pl.col("batch_key") == batch) & pair)
        missing.append(captions_without_rows(batch_caps, events, run["use_cases"], str(run["structurer"])))
    missing = (
        pl.concat(missing)
        if missing
        else pl.DataFrame(schema={"video_id": pl.String, "segment": pl.Int32, "use_case": pl.String})
    )
    orphans = rows_without_caption(events, caps)
    statuses = dict(events.group_by("status").len().sort("status").iter_rows())
    return AssetCheckResult(
        passed=missing.is_empty() and orphans.is_empty(),
        severity=AssetCheckSeverity.ERROR,
        metadata={
            **check_scope(batches),
            "rows": events.height,
            "missing_rows": missing.height,
            "rows_without_caption": orphans.height,
            "rows_without_digest": legacy_rows(events),
            "status_counts": statuses,
            "missing_examples": missing.head(10).select("video_id", "segment", "use_case").rows(),
            "orphan_examples": orphans.head(10).select("video_id", "segment", "use_case").rows(),
        },
    )


structuring_checks = [table_checks(STRUCTURED_EVENTS), structured_events_follow_captions]
