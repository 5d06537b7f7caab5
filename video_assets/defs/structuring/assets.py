"""Structuring stage asset: structured_events (caption prose -> schema-conforming rows per use case),
partitioned by upload batch; reruns are idempotent merges."""

import polars as pl
from dagster import AssetExecutionContext, Config, Failure, MaterializeResult, MetadataValue
from dagster_ray import RayResource
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import caption_versions
from video_assets.core.structuring.versions import plan_structuring, structuring_versions
from video_assets.core.tables import SCHEMAS, STRUCTURED_EVENTS
from video_assets.defs.common import ACCELERATOR_POOL, batch_asset, table_metadata
from video_assets.defs.engines import structuring_engine
from video_assets.defs.lineage import lineage_captions, structurer_id, use_case_version
from video_assets.defs.ray_session import connect_ray, ray_dashboard
from video_assets.defs.structured import structure_use_cases, write_structured


class StructuredEventsConfig(Config):
    restructure: bool = Field(default=False, description="Structure again captions already structured by this version")


@batch_asset("structuring", STRUCTURED_EVENTS, kinds=("mlflow",), deps=["captions"], pool=ACCELERATOR_POOL)
def structured_events(
    context: AssetExecutionContext,
    batch: str,
    config: StructuredEventsConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_on_demand: RayResource,
) -> MaterializeResult:
    """One row per caption and use case: verdict, confidence and timed events, decoded under the use
    case's JSON schema (xgrammar on CPU, vLLM structured outputs on GPU). A failed parse gets one
    verdict-only retry; what still fails is `unparsed` with the raw output; an errored caption is
    `no_caption`. Events are a list column (start_s, end_s, actor, action, object). The captions are
    those the captions step last wrote for the batch (their model and prompt versions come through
    lineage, not from the alias), and the 'captioner' structurer is that same model version."""
    try:
        use_cases = structurer.use_case_list()
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    caps, pair = lineage_captions(context, tables, batch)
    model_version, prompt_version = pair.model_version, pair.prompt_version
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    # Every row of the pair, of any structurer or use-case version: those whose caption was replaced
    # (a recaption, a new split) are stale, and their videos are rewritten.
    existing = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        caption_versions(model_version, prompt_version)
    )
    plan = plan_structuring(caps, existing, use_cases, sid, restructure=config.restructure)
    for uc in use_cases:
        todo = plan.todo[uc.name]
        context.log.info(
            f"{uc.name} (version {uc.version}): {len(todo)} captions to structure, {len(caps) - len(todo)} cached"
        )
    if plan.stale:
        context.log.info(f"{plan.stale} rows describe captions that were replaced or are gone: removed")
    work = [(uc, plan.todo[uc.name]) for uc in use_cases if plan.todo[uc.name]]
    new_rows: list[dict] = []
    engine = None  # none started when every caption is structured already
    if work:
        engine = structuring_engine(
            structurer, vlm, mlflow_registry, model_version, lambda: connect_ray(context, ray_on_demand)
        )
        context.log.info(f"structuring with {sid} on {getattr(engine, 'name', '?')}")
        # one engine for every use case of the batch (vLLM in the job: one engine lifetime, not one per use case)
        new_rows = structure_use_cases(engine, structurer, work, sid, context.log)
    # The affected videos' rows in one commit, as captions writes a video's: never a mix of old and new.
    write_structured(tables, STRUCTURED_EVENTS, plan, new_rows, model_version, prompt_version)
    written = len(new_rows)

    out = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        structuring_versions(model_version, prompt_version, sid) & pl.col("use_case").is_in([u.name for u in use_cases])
    )
    status = dict(out.group_by("status").len().sort("status").iter_rows())
    verdicts = dict(out.filter(pl.col("verdict").is_not_null()).group_by("verdict").len().sort("verdict").iter_rows())
    return MaterializeResult(
        data_version=use_case_version(pair, sid, use_cases),
        metadata={
            **table_metadata(
                tables.table_uri(STRUCTURED_EVENTS),
                out,
                tables.row_count(STRUCTURED_EVENTS),
                ["use_case", "uri", "segment", "status", "verdict", "confidence", "n_events", "error"],
            ),
            **pair.metadata(),
            "structurer": MetadataValue.text(sid),
            # The engine that answered (a served caption application, an endpoint, or one in the step);
            # "none" when every caption was already structured.
            "structuring_engine": MetadataValue.text(getattr(engine, "name", "?") if engine is not None else "none"),
            **ray_dashboard(ray_on_demand),
            "use_cases": MetadataValue.json({u.name: u.version for u in use_cases}),
            "status_counts": MetadataValue.json(status),
            "verdict_counts": MetadataValue.json(verdicts),
            "unparsed_rows": MetadataValue.int(status.get("unparsed", 0)),
            "rows_written": MetadataValue.int(written),
            "stale_rows_removed": MetadataValue.int(plan.stale),
            # Events the model placed outside their caption's clip, dropped from the rows (their error says which).
            "events_outside_clip": MetadataValue.int(int(out.get_column("events_outside").fill_null(0).sum())),
        },
    )
