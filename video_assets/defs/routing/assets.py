"""Routing stage assets: alerts and review_queue, from this batch's structured_events rows of the
production model and prompt. Partitioned by upload batch."""

from datetime import UTC, datetime

from dagster import AssetExecutionContext, AssetKey, AssetSpec, Config, MaterializeResult, MetadataValue, multi_asset
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core import routing
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.versions import structuring_versions
from video_assets.core.tables import ALERTS, REVIEW_QUEUE, SCHEMAS, STRUCTURED_EVENTS, to_arrow
from video_assets.defs.captioning.runner import batch_captions
from video_assets.defs.common import SINGLE_RUN, TRANSIENT_RETRY, per_batch, stage_asset, table_metadata
from video_assets.defs.models.assets import production_versions
from video_assets.defs.partitions import video_batches
from video_assets.defs.structuring.assets import structured_events
from video_assets.defs.structuring.runner import structurer_id, use_case_version


class RoutingConfig(Config):
    alert_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Override every use case's routing.alert_threshold"
    )


@multi_asset(
    specs=[
        AssetSpec(
            ALERTS,
            deps=[structured_events],
            partitions_def=video_batches,
            **stage_asset("routing", ALERTS),
            description="Confirmed or suspected rows at or above the use case's alert threshold, with evidence.",
        ),
        AssetSpec(
            REVIEW_QUEUE,
            deps=[structured_events],
            partitions_def=video_batches,
            **stage_asset("routing", REVIEW_QUEUE),
            description="Rows a person should look at: possible, below threshold, verdict-only or unparsed.",
        ),
    ],
    backfill_policy=SINGLE_RUN,
    # Idempotent (the batch's rows are replaced in one commit per table): retried on transient errors.
    retry_policy=TRANSIENT_RETRY,
)
def routed_events(
    context: AssetExecutionContext,
    config: RoutingConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
):
    """Routes this batch's structured_events rows of the production model/prompt. The batch's rows in
    both tables are replaced, so a new threshold moves rows between them on a rerun."""
    yield from per_batch(
        context, lambda batch: _routed_events_batch(batch, context, config, vlm, structurer, mlflow_registry, tables)
    )


def _routed_events_batch(
    batch: str,
    context: AssetExecutionContext,
    config: RoutingConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
):
    model_version, prompt_version = production_versions(vlm, mlflow_registry)
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    use_cases = uc_mod.parse_names(structurer.use_cases)
    events = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        structuring_versions(model_version, prompt_version, sid)
    )
    prose = {
        (v, s): p
        for v, s, p in batch_captions(tables, batch, model_version, prompt_version)
        .select("video_id", "segment", "prose")
        .iter_rows()
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
                model_version,
                prompt_version,
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
                "thresholds": MetadataValue.json(thresholds),
            },
        )
