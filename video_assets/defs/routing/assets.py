"""Routing stage assets: alerts and review_queue, from this batch's structured_events rows of the
caption pair structured_events last structured (lineage). Partitioned by upload batch."""

from datetime import UTC, datetime

import polars as pl
from dagster import AssetExecutionContext, AssetKey, AssetSpec, Config, MaterializeResult, MetadataValue
from pydantic import Field

from resources.delta import DeltaTables
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core import routing
from video_assets.core.structuring.versions import structuring_versions
from video_assets.core.tables import ALERTS, REVIEW_QUEUE, SCHEMAS, STREAM_SEGMENTS, STRUCTURED_EVENTS, to_arrow
from video_assets.defs.common import TRANSIENT_RETRY, batch_asset, stage_asset, table_metadata
from video_assets.defs.lineage import batch_captions, structurer_id, upstream_pair, use_case_version


class RoutingConfig(Config):
    alert_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Override every use case's routing.alert_threshold"
    )


@batch_asset(
    "routing",
    specs=[
        AssetSpec(
            ALERTS,
            deps=["structured_events", STREAM_SEGMENTS],
            **stage_asset("routing", ALERTS),
            description="Confirmed or suspected rows at or above the use case's alert threshold, with evidence.",
        ),
        AssetSpec(
            REVIEW_QUEUE,
            deps=["structured_events", STREAM_SEGMENTS],
            **stage_asset("routing", REVIEW_QUEUE),
            description="Rows a person should look at: possible, below threshold, verdict-only or unparsed.",
        ),
    ],
    # Idempotent (the batch's rows are replaced in one commit per table): retried on transient errors.
    retry_policy=TRANSIENT_RETRY,
)
def routed_events(
    context: AssetExecutionContext,
    batch: str,
    config: RoutingConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    tables: DeltaTables,
):
    """Routes this batch's structured_events rows: those of the caption pair structured_events last
    structured for the batch (lineage, not the alias). The batch's rows in both tables are replaced,
    so a new threshold moves rows between them on a rerun."""
    pair = upstream_pair(context, batch, STRUCTURED_EVENTS)
    model_version, prompt_version = pair.model_version, pair.prompt_version
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    use_cases = structurer.use_case_list()
    events = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        structuring_versions(model_version, prompt_version, sid)
    )
    prose = {
        (v, s): p for v, s, p in batch_captions(tables, batch, pair).select("video_id", "segment", "prose").iter_rows()
    }
    now = datetime.now(UTC)
    alerts, review, thresholds = [], [], {}
    for uc in use_cases:
        threshold = uc.alert_threshold if config.alert_threshold is None else config.alert_threshold
        thresholds[uc.name] = threshold
        rows = events.filter(structuring_versions(model_version, prompt_version, sid, uc)).to_dicts()
        a, r = routing.split(rows, threshold, prose)
        alerts += a
        review += r
    # A camera's segment: each row in the camera's own time, and how long after the moment it was routed.
    uris = sorted({r["uri"] for r in alerts + review})
    segments = {}
    if uris and tables.exists(STREAM_SEGMENTS):
        found = tables.read(STREAM_SEGMENTS, SCHEMAS[STREAM_SEGMENTS], where=pl.col("uri").is_in(uris))
        segments = {s["uri"]: s for s in found.to_dicts()}
    alerts = [{**a, **routing.wall_clock(a, segments.get(a["uri"]), now)} for a in alerts]
    review = [{**r, **routing.wall_clock(r, segments.get(r["uri"]), now)} for r in review]
    for name, rows in ((ALERTS, alerts), (REVIEW_QUEUE, review)):
        cols = SCHEMAS[name].names
        # The batch's rows replaced in one commit (a crash leaves the old rows or the new, never none);
        # written even when empty: the table exists (with its schema) for every query after a first run.
        tables.replace(
            name,
            to_arrow(name, [{**{c: r.get(c) for c in cols}, "routed_at": now} for r in rows]),
            "batch_key",
            [batch],
        )
        context.log.info(f"{name}: {len(rows)} rows for batch {batch}")
        out = tables.batch(name, batch, SCHEMAS[name])
        yield MaterializeResult(
            asset_key=AssetKey(name),
            data_version=use_case_version(
                pair,
                sid,
                use_cases,
                extra="-thresholds-" + ",".join(f"{t:g}" for t in thresholds.values()),
            ),
            metadata={
                **table_metadata(
                    tables.table_uri(name),
                    out,
                    tables.row_count(name),
                    ["use_case", "uri", "start_s", "end_s", "verdict", "confidence", "reason"],
                ),
                **pair.metadata(),
                "thresholds": MetadataValue.json(thresholds),
                **(
                    {"camera_median_detected_after_s": MetadataValue.float(_median_delay(rows))}
                    if any(r["detected_after_s"] is not None for r in rows)
                    else {}
                ),
            },
        )


def _median_delay(rows: list[dict]) -> float:
    delays = sorted(r["detected_after_s"] for r in rows if r["detected_after_s"] is not None)
    return float(delays[len(delays) // 2])
