"""Inference-group assets after captions: structured_events (prose -> schema rows), then routing
into alerts and review_queue. All partitioned by upload batch; reruns are idempotent merges."""

from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetSpec,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    multi_asset,
)
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import VlmSettings
from video_assets import routing
from video_assets import usecase as uc_mod
from video_assets.captions import caption_versions, captions
from video_assets.model import CAPTION_PROMPT_NAME
from video_assets.partitions import video_batches
from video_assets.previews import table_metadata
from video_assets.structuring import structure_captions
from video_assets.tables import (
    ALERTS,
    CAPTIONS,
    KEYS,
    REVIEW_QUEUE,
    SCHEMAS,
    STRUCTURED_EVENTS,
    column_schema,
    to_arrow,
)


class StructuredEventsConfig(Config):
    restructure: bool = Field(default=False, description="Structure again captions already structured by this version")


class RoutingConfig(Config):
    alert_threshold: float | None = Field(
        default=None, ge=0, le=1, description="Override every use case's routing.alert_threshold"
    )


def structurer_id(settings: StructurerSettings, model_name: str, model_version: str) -> str:
    return f"{model_name}/v{model_version}" if settings.model == CAPTIONER else settings.model


def make_structurer(settings: StructurerSettings, captioner_path: Path | str):
    """The engine for ``settings`` (the captioning model's folder when model is 'captioner')."""
    from video_assets.engines import choose_engine_name

    model = str(captioner_path) if settings.model == CAPTIONER else settings.model
    if choose_engine_name(settings.engine) == "vllm":
        from video_assets.structuring import VllmStructurer

        return VllmStructurer(model, settings.vllm_settings())
    from video_assets.structuring import TransformersStructurer

    return TransformersStructurer(model, settings.device, settings.batch_size)


def structure_rows(engine, settings: StructurerSettings, uc: uc_mod.UseCase, caption_rows: list[dict], structurer: str, log=None) -> list[dict]:
    """structured_events rows for caption rows (dicts of the captions table), one per caption."""
    now = datetime.now(timezone.utc)
    results = structure_captions(engine, uc, caption_rows, settings.max_new_tokens, settings.retry_max_new_tokens)
    out = []
    for n, (c, r) in enumerate(zip(caption_rows, results), start=1):
        if log is not None:
            name = c["uri"].rsplit("/", 1)[-1]
            log.info(f"[{n}/{len(caption_rows)}] {uc.name} {name} segment {c['segment']}: {r['status']}"
                     + (f" {r['verdict']}" if r["verdict"] else "") + (f" ({r['error']})" if r["error"] else ""))
        out.append({
            "video_id": c["video_id"], "segment": c["segment"], "use_case": uc.name,
            "model_version": c["model_version"], "prompt_version": c["prompt_version"],
            "use_case_version": uc.version, "structurer": structurer, "batch_key": c["batch_key"], "uri": c["uri"],
            "segment_start_s": c.get("segment_start_s"), "segment_end_s": c.get("segment_end_s"),
            **r, "n_events": len(r["events"]), "structured_at": now,
        })
    return out


def structuring_versions(model_version: str, prompt_version: int, structurer: str, uc: uc_mod.UseCase | None = None) -> pl.Expr:
    """structured_events rows of one caption pair and structuring model (and use case version, if given)."""
    expr = caption_versions(model_version, prompt_version) & (pl.col("structurer") == structurer)
    if uc is not None:
        expr = expr & (pl.col("use_case") == uc.name) & (pl.col("use_case_version") == uc.version)
    return expr


def pending_captions(caption_rows: list[dict], events: pl.DataFrame, uc: uc_mod.UseCase) -> list[dict]:
    """Caption rows without a row of the use case's current version in ``events`` (already filtered
    to the caption pair and structurer): what is left to structure."""
    done = events.filter((pl.col("use_case") == uc.name) & (pl.col("use_case_version") == uc.version))
    keys = set(zip(done.get_column("video_id").to_list(), done.get_column("segment").to_list()))
    return [c for c in caption_rows if (c["video_id"], c["segment"]) not in keys]


def production_versions(vlm: VlmSettings, mlflow_registry: MlflowRegistry) -> tuple[str, int]:
    try:
        model = mlflow_registry.resolve_alias(vlm.registered_model, vlm.alias)
        prompt = mlflow_registry.load_prompt(CAPTION_PROMPT_NAME, vlm.alias)
    except Exception as exc:
        raise Failure(f"cannot resolve the {vlm.alias} model/prompt in {mlflow_registry.tracking_uri}: {exc}. "
                      "Materialise vlm_model and caption_prompt (job register_model) first.") from exc
    return str(model.version), int(prompt.version)


def _batch_captions(tables: DeltaTables, batch: str, model_version: str, prompt_version: int) -> pl.DataFrame:
    return tables.read(CAPTIONS, SCHEMAS[CAPTIONS]).filter(
        (pl.col("batch_key") == batch) & caption_versions(model_version, prompt_version)
    )


@asset(
    partitions_def=video_batches,
    deps=[captions],
    group_name="inference",
    kinds={"delta", "mlflow"},
    owners=["team:video-platform"],
    code_version="1",
    metadata={"dagster/column_schema": column_schema(STRUCTURED_EVENTS)},
)
def structured_events(
    context: AssetExecutionContext,
    config: StructuredEventsConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
) -> MaterializeResult:
    """One row per caption and use case: verdict, confidence and timed events, decoded under the use
    case's JSON schema (xgrammar on CPU, vLLM structured outputs on GPU). A failed parse gets one
    verdict-only retry; what still fails is `unparsed` with the raw output; an errored caption is
    `no_caption`. Events are a list column (start_s, end_s, actor, action, object)."""
    batch = context.partition_key
    try:
        use_cases = uc_mod.parse_names(structurer.use_cases)
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    model_version, prompt_version = production_versions(vlm, mlflow_registry)
    caps = _batch_captions(tables, batch, model_version, prompt_version)
    if caps.is_empty():
        raise Failure(f"captions has no rows for batch {batch!r} with model v{model_version} and prompt "
                      f"v{prompt_version}: materialise captions for this batch first")
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    existing = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS]).filter(
        (pl.col("batch_key") == batch) & structuring_versions(model_version, prompt_version, sid)
    )
    plan = {}
    for uc in use_cases:
        todo = caps.to_dicts() if config.restructure else pending_captions(caps.to_dicts(), existing, uc)
        plan[uc.name] = (uc, todo)
        context.log.info(f"{uc.name} (version {uc.version}): {len(todo)} captions to structure, {len(caps) - len(todo)} cached")
    engine = None
    written = 0
    for uc, todo in plan.values():
        if not todo:
            continue
        if engine is None:
            path = mlflow_registry.download_model(vlm.registered_model, vlm.alias, Path(vlm.cache_dir) / "registry")[0] \
                if structurer.model == CAPTIONER else None
            engine = make_structurer(structurer, path)
            context.log.info(f"structuring with {sid} on {getattr(engine, 'name', '?')}")
        rows = structure_rows(engine, structurer, uc, todo, sid, context.log)
        tables.merge(STRUCTURED_EVENTS, to_arrow(STRUCTURED_EVENTS, rows), KEYS[STRUCTURED_EVENTS])
        written += len(rows)

    after = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS])
    out = after.filter(
        (pl.col("batch_key") == batch) & structuring_versions(model_version, prompt_version, sid)
        & pl.col("use_case").is_in([u.name for u in use_cases])
    )
    status = dict(out.group_by("status").len().sort("status").iter_rows())
    verdicts = dict(out.filter(pl.col("verdict").is_not_null()).group_by("verdict").len().sort("verdict").iter_rows())
    return MaterializeResult(
        metadata={
            **table_metadata(tables.table_uri(STRUCTURED_EVENTS), out, after.height,
                             ["use_case", "uri", "segment", "status", "verdict", "confidence", "n_events", "error"]),
            "structurer": MetadataValue.text(sid),
            "use_cases": MetadataValue.json({u.name: u.version for u in use_cases}),
            "status_counts": MetadataValue.json(status),
            "verdict_counts": MetadataValue.json(verdicts),
            "unparsed_rows": MetadataValue.int(status.get("unparsed", 0)),
            "rows_written": MetadataValue.int(written),
        }
    )


@multi_asset(
    specs=[
        AssetSpec("alerts", deps=[structured_events], partitions_def=video_batches, group_name="inference",
                  kinds={"delta"}, owners=["team:video-platform"], code_version="1",
                  description="Confirmed or suspected rows at or above the use case's alert threshold, with evidence.",
                  metadata={"dagster/column_schema": column_schema(ALERTS)}),
        AssetSpec("review_queue", deps=[structured_events], partitions_def=video_batches, group_name="inference",
                  kinds={"delta"}, owners=["team:video-platform"], code_version="1",
                  description="Rows a person should look at: possible, below threshold, verdict-only or unparsed.",
                  metadata={"dagster/column_schema": column_schema(REVIEW_QUEUE)}),
    ],
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
    batch = context.partition_key
    model_version, prompt_version = production_versions(vlm, mlflow_registry)
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    use_cases = uc_mod.parse_names(structurer.use_cases)
    events = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS]).filter(
        (pl.col("batch_key") == batch) & structuring_versions(model_version, prompt_version, sid)
    )
    prose = {(v, s): p for v, s, p in _batch_captions(tables, batch, model_version, prompt_version)
             .select("video_id", "segment", "prose").iter_rows()}
    now = datetime.now(timezone.utc)
    alerts, review, thresholds = [], [], {}
    for uc in use_cases:
        threshold = uc.alert_threshold if config.alert_threshold is None else config.alert_threshold
        thresholds[uc.name] = threshold
        rows = events.filter(structuring_versions(model_version, prompt_version, sid, uc)).to_dicts()
        a, r = routing.split(rows, threshold, prose)
        alerts += a
        review += r
    for name, rows in ((ALERTS, alerts), (REVIEW_QUEUE, review)):
        tables.delete(name, f"batch_key = '{batch}'")
        cols = SCHEMAS[name].names
        # Merged even when empty: the table exists (with its schema) for every query after a first run.
        tables.merge(name, to_arrow(name, [{**{c: r.get(c) for c in cols}, "routed_at": now} for r in rows]), KEYS[name])
        context.log.info(f"{name}: {len(rows)} rows for batch {batch}")
        after = tables.read(name, SCHEMAS[name])
        out = after.filter(pl.col("batch_key") == batch)
        yield MaterializeResult(
            asset_key=AssetKey(name),
            metadata={
                **table_metadata(tables.table_uri(name), out, after.height,
                                 ["use_case", "uri", "start_s", "end_s", "verdict", "confidence", "reason"]),
                "thresholds": MetadataValue.json(thresholds),
            },
        )
