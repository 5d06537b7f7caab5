"""Eval-gated promotion: a challenger model or caption prompt (alias ``challenger``) replaces
production only when, on a use case's golden set, no gated metric drops more than a tolerance.

``decide`` is the pure rule; the ``promote_challenger`` job captions and structures the golden
videos with each candidate where not done yet, scores both (eval_scores rows + MLflow runs), records
the decision in ``promotion_decisions`` and moves the aliases."""

import uuid
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    Config,
    DefaultSensorStatus,
    Failure,
    OpExecutionContext,
    Out,
    Output,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)
from dagster_ray import RayResource
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import VlmSettings
from video_assets import usecase as uc_mod
from video_assets.captions import CaptionsConfig, _engine_name, caption_versions, captioned_ok, job_spec, run_captioning
from video_assets.evaluate import evaluate_candidate, golden_rows
from video_assets.events import make_structurer, pending_captions, structure_rows, structurer_id, structuring_versions
from video_assets.model import CAPTION_PROMPT_NAME, CHALLENGER
from video_assets.tables import CAPTIONS, HEADLINE_METRICS, KEYS, PROMOTIONS, SCHEMAS, STRUCTURED_EVENTS, VIDEO_METADATA, to_arrow

GATED = ("flagged_f1", "macro_f1", "event_f1", "coverage")


def decide(production: dict, challenger: dict, tolerance: float, metrics=GATED) -> tuple[bool, str]:
    """(promote, reason): promote unless some gated metric drops by more than ``tolerance``."""
    lines = [f"{m} {production[m]:.3f} -> {challenger[m]:.3f}" for m in metrics]
    worse = [m for m in metrics if production[m] - challenger[m] > tolerance]
    if worse:
        return False, f"rejected: {', '.join(worse)} dropped by more than {tolerance:g} ({'; '.join(lines)})"
    return True, f"promoted: no metric dropped by more than {tolerance:g} ({'; '.join(lines)})"


class PromotionConfig(Config):
    use_case: str = Field(default="object_handling", description="Use case whose golden set gates the promotion")
    tolerance: float = Field(default=0.02, ge=0, description="Largest allowed drop of any gated metric")
    metrics: list[str] = Field(default=list(GATED), description="Gated metrics (columns of eval_scores)")
    iou_threshold: float = Field(default=0.3, gt=0, le=1)
    bootstrap: int = Field(default=200, ge=10)
    max_frames: int = Field(default=16, ge=1, description="Frames per segment when captioning golden videos")
    min_frames: int = Field(default=8, ge=1)


def _ensure_captions(context, tables, vlm, registry, videos: pl.DataFrame, model_alias, prompt_alias, mv, pv, cfg) -> Path:
    """Caption the golden videos this (model, prompt) has not captioned yet; returns the model folder."""
    path, _ = registry.download_model(vlm.registered_model, model_alias, Path(vlm.cache_dir) / "registry")
    done = captioned_ok(tables.read(CAPTIONS, SCHEMAS[CAPTIONS]), mv, pv)
    todo = videos.filter(~pl.col("video_id").is_in(done))
    context.log.info(f"model v{mv} prompt v{pv}: {todo.height} golden videos to caption, {videos.height - todo.height} cached")
    if todo.height:
        prompt = registry.load_prompt(CAPTION_PROMPT_NAME, prompt_alias)
        engine = _engine_name(vlm)
        spec = job_spec(CaptionsConfig(max_frames=cfg.max_frames, min_frames=cfg.min_frames), vlm, engine, path, prompt.template)
        stamp = {"model_name": vlm.registered_model, "model_version": mv, "prompt_version": pv, "engine": engine}
        run_captioning(context.log, tables, todo, spec, stamp)
    return path


def _ensure_structured(context, tables, settings, uc, path, ids, mv, pv, sid) -> None:
    caps = tables.read(CAPTIONS, SCHEMAS[CAPTIONS]).filter(caption_versions(mv, pv) & pl.col("video_id").is_in(ids))
    events = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS]).filter(structuring_versions(mv, pv, sid))
    todo = pending_captions(caps.to_dicts(), events, uc)
    if todo:
        rows = structure_rows(make_structurer(settings, path), settings, uc, todo, sid, context.log)
        tables.merge(STRUCTURED_EVENTS, to_arrow(STRUCTURED_EVENTS, rows), KEYS[STRUCTURED_EVENTS])


@op(out=Out(dict), description="Evaluate challenger vs production on the golden set; move production only if no gated metric regresses.")
def evaluate_and_promote(
    context: OpExecutionContext,
    config: PromotionConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
):
    reg, name = mlflow_registry, vlm.registered_model
    pm, cm = reg.alias_version("model", name, vlm.alias), reg.alias_version("model", name, CHALLENGER)
    pp, cp = reg.alias_version("prompt", CAPTION_PROMPT_NAME, vlm.alias), reg.alias_version("prompt", CAPTION_PROMPT_NAME, CHALLENGER)
    if pm is None or pp is None:
        raise Failure("no production model or prompt yet: run the register_model job first")
    if cm is None and cp is None:
        context.log.info("no challenger model or prompt: nothing to evaluate")
        return Output({"promoted": None}, metadata={"decision": "no challenger"})
    try:
        uc = uc_mod.load(config.use_case)
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    unknown = [m for m in config.metrics if m not in HEADLINE_METRICS]  # the columns an eval_scores row has
    if unknown:
        raise Failure(f"unknown gated metrics {unknown}")
    ids = [g["video_id"] for g in golden_rows(tables, uc.name)]
    videos = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA]).filter(pl.col("ok") & pl.col("video_id").is_in(ids))
    if videos.is_empty():
        raise Failure(f"none of the {len(ids)} golden videos of {uc.name!r} is registered and readable: "
                      "register the sample clips (video-assets register) and materialise golden_set first")
    candidates = {
        "production": (pm, int(pp), vlm.alias, vlm.alias),
        "challenger": (cm or pm, int(cp or pp), CHALLENGER if cm else vlm.alias, CHALLENGER if cp else vlm.alias),
    }
    results = {}
    for label, (mv, pv, model_alias, prompt_alias) in candidates.items():
        context.log.info(f"{label}: model v{mv} ({model_alias}), prompt v{pv} ({prompt_alias}) on {videos.height} golden videos")
        path = _ensure_captions(context, tables, vlm, reg, videos, model_alias, prompt_alias, mv, pv, config)
        sid = structurer_id(structurer, name, mv)
        _ensure_structured(context, tables, structurer, uc, path if structurer.model == CAPTIONER else None,
                           videos.get_column("video_id").to_list(), mv, pv, sid)
        results[label] = evaluate_candidate(tables, reg, uc, label, name, mv, pv, sid, config.iou_threshold, config.bootstrap)
    (prow, _), (crow, _) = results["production"], results["challenger"]
    promoted, reason = decide(prow, crow, config.tolerance, config.metrics)
    context.log.info(reason)
    if promoted:
        if cm:
            reg.set_alias("model", name, vlm.alias, cm)
        if cp:
            reg.set_alias("prompt", CAPTION_PROMPT_NAME, vlm.alias, cp)
    # Either way the challenger has had its evaluation: the alias is cleared, the verdict kept as a tag.
    if cm:
        reg.client().set_model_version_tag(name, cm, "promotion", reason[:500])
        reg.delete_alias("model", name, CHALLENGER)
    if cp:
        reg.delete_alias("prompt", CAPTION_PROMPT_NAME, CHALLENGER)
    decision = {
        "decision_id": uuid.uuid4().hex[:16], "decided_at": datetime.now(timezone.utc), "use_case": uc.name,
        "production_model_version": pm, "production_prompt_version": int(pp),
        "challenger_model_version": cm or pm, "challenger_prompt_version": int(cp or pp),
        "promoted": promoted, "reason": reason, "tolerance": config.tolerance,
        "production_eval_id": prow["eval_id"], "challenger_eval_id": crow["eval_id"],
    }
    tables.merge(PROMOTIONS, to_arrow(PROMOTIONS, [decision]), KEYS[PROMOTIONS])
    return Output(
        {"promoted": promoted, "reason": reason, "decision_id": decision["decision_id"]},
        metadata={"promoted": promoted, "reason": reason,
                  "production": {m: round(prow[m], 4) for m in config.metrics},
                  "challenger": {m: round(crow[m], 4) for m in config.metrics},
                  "production_now": f"model v{reg.alias_version('model', name, vlm.alias)}, prompt v{reg.alias_version('prompt', CAPTION_PROMPT_NAME, vlm.alias)}"},
    )


@job(name="promote_challenger", description="Evaluate the challenger model/prompt against production on a golden set and promote it only if it does not regress.",
     tags={"video/kind": "promotion"})
def promote_challenger_job():
    evaluate_and_promote()


@sensor(
    job=promote_challenger_job,
    minimum_interval_seconds=120,
    default_status=DefaultSensorStatus.STOPPED,
    description="Starts promote_challenger when a model or prompt version appears behind `challenger`; "
    "one run per distinct challenger pair (run_key). Stopped by default.",
)
def challenger_sensor(context: SensorEvaluationContext, vlm: VlmSettings, mlflow_registry: MlflowRegistry):
    cm = mlflow_registry.alias_version("model", vlm.registered_model, CHALLENGER)
    cp = mlflow_registry.alias_version("prompt", CAPTION_PROMPT_NAME, CHALLENGER)
    if cm is None and cp is None:
        return SkipReason("no challenger model or prompt")
    return RunRequest(run_key=f"model-{cm}-prompt-{cp}", tags={"video/challenger_model": str(cm), "video/challenger_prompt": str(cp)})
