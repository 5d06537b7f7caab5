"""Promotion stage: a challenger model or caption prompt (alias ``challenger``) replaces production only
when, on a use case's golden set, no gated metric is worse by more than a tolerance at the configured
confidence (a paired bootstrap over the golden videos, ``core.evaluation.gate.paired_gate``); with fewer
labelled videos than ``min_videos`` it does not decide (and promotes only when forced).

One multi-asset, declared as what it writes: the golden videos captioned and structured by each
candidate where not done yet (``candidate_captions``, ``candidate_events``), both candidates' scores
(``candidate_scores`` rows + MLflow runs) and the decision (``promotion_decisions``); then the aliases
move. The pipeline's own tables (captions, structured_events, eval_scores) hold only what their assets
wrote, so lineage read from them stays true."""

import json
import uuid
from datetime import UTC, datetime

import polars as pl
from dagster import (
    AssetExecutionContext,
    AssetMaterialization,
    AssetSpec,
    Config,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    multi_asset,
)
from dagster_ray import RayResource
from pydantic import Field

from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import caption_versions, captioned_ok, split_key
from video_assets.core.evaluation.diff import FLIPS, counts, fact_diff
from video_assets.core.evaluation.gate import GATED, PROMOTE, UNDECIDED, paired_gate
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.links import clip_url
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.versions import plan_structuring
from video_assets.core.tables import (
    CANDIDATE_CAPTIONS,
    CANDIDATE_EVENTS,
    CANDIDATE_SCORES,
    HEADLINE_METRICS,
    KEYS,
    PROMOTION_DIFFS,
    PROMOTIONS,
    RAW_VIDEOS,
    SCHEMAS,
    VIDEO_METADATA,
    to_arrow,
)
from video_assets.core.uploads.discovery import printable
from video_assets.defs.caption_job import run_captioning
from video_assets.defs.common import ACCELERATOR_POOL, stage_asset, table_metadata
from video_assets.defs.engines import captions_job_spec, make_structurer, registered_model_files
from video_assets.defs.lineage import golden_rows, structurer_id
from video_assets.defs.registry import CAPTION_PROMPT_NAME, CHALLENGER
from video_assets.defs.scoring import candidate_predictions, evaluate_candidate
from video_assets.defs.structured import structure_rows, write_structured

# The tag that carries a materialisation's data version: the string Dagster documents (the REST API's
# ``data_version`` field sets it); its constant lives in a private module (dagster._core.definitions).
DATA_VERSION_TAG = "dagster/data_version"


class PromotionConfig(Config):
    use_case: str = Field(default="object_handling", description="Use case whose golden set gates the promotion")
    tolerance: float = Field(default=0.02, ge=0, description="Largest allowed drop of any gated metric")
    confidence: float = Field(
        default=0.9, gt=0, lt=1, description="Confidence of the paired bootstrap interval of each metric's change"
    )
    min_videos: int = Field(
        default=10, ge=1, description="Fewer golden videos scored by both candidates: the gate does not decide"
    )
    force: bool = Field(default=False, description="Promote when the gate cannot decide (too few videos)")
    shadow_videos: int = Field(
        default=20, ge=0, description="The archive's most recent videos also compared in the fact diff (0: golden only)"
    )
    metrics: list[str] = Field(default=list(GATED), description="Gated metrics (columns of eval_scores)")
    iou_threshold: float = Field(default=0.3, gt=0, le=1)
    bootstrap: int = Field(default=200, ge=10, description="Bootstrap resamples (the gate's paired ones too)")
    max_frames: int = Field(default=16, ge=1, description="Frames per segment when captioning golden videos")
    min_frames: int = Field(default=8, ge=1)


def _ensure_captions(
    context, tables, vlm, registry, videos: pl.DataFrame, model_alias, prompt_alias, mv, pv, cfg
) -> ModelFiles:
    """Caption the golden videos this (model, prompt) has not captioned yet; returns the model's files."""
    model, _ = registered_model_files(registry, vlm, model_alias)
    sampling = SamplingConfig(min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    done = captioned_ok(tables.read(CANDIDATE_CAPTIONS, SCHEMAS[CANDIDATE_CAPTIONS]), mv, pv, split_key(sampling))
    todo = videos.filter(~pl.col("video_id").is_in(done))
    context.log.info(
        f"model v{mv} prompt v{pv}: {todo.height} golden videos to caption, {videos.height - todo.height} cached"
    )
    if todo.height:
        prompt = registry.load_prompt(CAPTION_PROMPT_NAME, prompt_alias)
        spec = captions_job_spec(vlm, model, prompt.template, sampling, calibration=lambda engine: None)
        stamp = {
            "model_name": vlm.registered_model,
            "model_version": mv,
            "prompt_version": pv,
            "engine": spec.engine.name,
        }
        stats = run_captioning(context.log, tables, todo, spec, stamp, table=CANDIDATE_CAPTIONS)
        context.log.info(f"model v{mv} prompt v{pv}: {int(stats['written'])} candidate caption rows written")
    return model


def report_production(instance, alias: str, decision_id: str, model_version=None, prompt_version=None) -> None:
    """What is in production is the data version of vlm_model / caption_prompt: reported when it moves, so
    Dagster's staleness view marks every batch captioned before as stale (``video-assets reprocess`` redoes
    exactly those)."""
    for asset, version in (("vlm_model", model_version), ("caption_prompt", prompt_version)):
        if version:
            instance.report_runless_asset_event(
                AssetMaterialization(
                    asset_key=asset,
                    tags={DATA_VERSION_TAG: f"v{version}"},
                    metadata={"alias": alias, "version": str(version), "promoted_by": decision_id},
                )
            )


def _shadow_sample(tables: DeltaTables, readable: pl.DataFrame, golden_ids: list[str], n: int) -> list[str]:
    """The ``n`` most recently registered readable videos that are not golden: what the challenger would
    change on the archive as it is now, not only on the labelled clips."""
    if n <= 0:
        return []
    raw = tables.read(RAW_VIDEOS, SCHEMAS[RAW_VIDEOS]).filter(
        pl.col("video_id").is_in(readable.get_column("video_id")) & ~pl.col("video_id").is_in(golden_ids)
    )
    return raw.sort(["registered_at", "video_id"], descending=True).head(n).get_column("video_id").to_list()


def _flips_table(diffs: list[dict], service_url: str, limit: int = 50) -> str:
    """The flips as markdown (they come first in ``diffs``), each with a link that plays its clip on the
    service at ``service_url`` (VIDEO_SERVICE_URL: the same address alert payloads link to)."""
    flips = [d for d in diffs if d["change"] in FLIPS]
    if not flips:
        return "_no video changes its answer_"
    lines = ["| change | video | sample | golden | production | challenger | clip |", "|---|---|---|---|---|---|---|"]
    for d in flips[:limit]:
        name = printable((d["uri"] or d["video_id"]).rsplit("/", 1)[-1])
        link = f"[play]({clip_url(service_url, d['video_id'], d['start_s'] or 0.0, d['end_s'])})"
        lines.append(
            f"| {d['change']} | {name} | {d['sample']} | {d['expected'] or ''} | {d['production_verdict']} | "
            f"{d['challenger_verdict']} | {link} |"
        )
    if len(flips) > limit:
        lines.append(f"\n{len(flips) - limit} more in promotion_diffs")
    return "\n".join(lines)


def _ensure_structured(context, tables, settings, uc, model: ModelFiles, ids, mv, pv, sid) -> None:
    caps = tables.read(CANDIDATE_CAPTIONS, SCHEMAS[CANDIDATE_CAPTIONS]).filter(
        caption_versions(mv, pv) & pl.col("video_id").is_in(ids)
    )
    events = tables.read(CANDIDATE_EVENTS, SCHEMAS[CANDIDATE_EVENTS]).filter(
        caption_versions(mv, pv) & pl.col("video_id").is_in(ids)
    )
    plan = plan_structuring(caps, events, [uc], sid)
    todo = plan.todo[uc.name]
    rows = structure_rows(make_structurer(settings, model), settings, uc, todo, sid, context.log) if todo else []
    write_structured(tables, CANDIDATE_EVENTS, plan, rows, mv, pv)


def _spec(table: str, description: str, kinds: tuple[str, ...] = ()) -> AssetSpec:
    # skippable: no challenger, nothing decided, nothing materialised
    return AssetSpec(
        table,
        deps=["eval_scores", "golden_set", "vlm_model", "caption_prompt"],
        skippable=True,
        description=description,
        **stage_asset("promotion", table, kinds=kinds),
    )


@multi_asset(
    name="promotion",
    specs=[
        _spec(CANDIDATE_CAPTIONS, "The golden videos captioned by each candidate (captions' schema).", ("ray",)),
        _spec(CANDIDATE_EVENTS, "The candidates' captions structured per use case (structured_events' schema)."),
        _spec(CANDIDATE_SCORES, "Each candidate's scores on the golden set (eval_scores' schema).", ("mlflow",)),
        _spec(PROMOTIONS, "One row per promotion decision, with its reason.", ("mlflow",)),
        _spec(PROMOTION_DIFFS, "What the challenger changes: both answers per video, flips first (the fact diff)."),
    ],
    # No retry policy: an attempt records MLflow runs and may record a decision; a rerun is the operator's.
    pool=ACCELERATOR_POOL,
)
def promotion(
    context: AssetExecutionContext,
    config: PromotionConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
    alert_delivery: AlertDestinations,
):
    """Challenger vs production on a golden set, each captioned, structured and scored in the promotion's
    own tables; one decision row; production moves only if no gated metric regresses. Run by the
    promote_challenger job (or challenger_sensor)."""
    reg, name = mlflow_registry, vlm.registered_model
    pm, cm = reg.alias_version("model", name, vlm.alias), reg.alias_version("model", name, CHALLENGER)
    pp, cp = (
        reg.alias_version("prompt", CAPTION_PROMPT_NAME, vlm.alias),
        reg.alias_version("prompt", CAPTION_PROMPT_NAME, CHALLENGER),
    )
    if pm is None or pp is None:
        raise Failure("no production model or prompt yet: run the register_model job first")
    if cm is None and cp is None:
        context.log.info("no challenger model or prompt: nothing to evaluate")
        return
    try:
        uc = uc_mod.load(config.use_case)
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    unknown = [m for m in config.metrics if m not in HEADLINE_METRICS]  # the columns an eval_scores row has
    if unknown:
        raise Failure(f"unknown gated metrics {unknown}")
    golden = golden_rows(tables, uc.name)
    ids = [g["video_id"] for g in golden]
    readable = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA]).filter(pl.col("ok"))
    if readable.filter(pl.col("video_id").is_in(ids)).is_empty():
        raise Failure(
            f"none of the {len(ids)} golden videos of {uc.name!r} is registered and readable: "
            "register the sample clips (video-assets register) and materialise golden_set first"
        )
    shadow = _shadow_sample(tables, readable, ids, config.shadow_videos)
    videos = readable.filter(pl.col("video_id").is_in(ids + shadow))
    candidates = {
        "production": (pm, int(pp), vlm.alias, vlm.alias),
        "challenger": (cm or pm, int(cp or pp), CHALLENGER if cm else vlm.alias, CHALLENGER if cp else vlm.alias),
    }
    results = {}
    for label, (mv, pv, model_alias, prompt_alias) in candidates.items():
        context.log.info(
            f"{label}: model v{mv} ({model_alias}), prompt v{pv} ({prompt_alias}) on {videos.height - len(shadow)} "
            f"golden videos and {len(shadow)} recent archive videos (the fact diff's shadow sample)"
        )
        path = _ensure_captions(context, tables, vlm, reg, videos, model_alias, prompt_alias, mv, pv, config)
        sid = structurer_id(structurer, name, mv)
        _ensure_structured(
            context,
            tables,
            structurer,
            uc,
            path if structurer.model == CAPTIONER else None,
            videos.get_column("video_id").to_list(),
            mv,
            pv,
            sid,
        )
        results[label] = evaluate_candidate(
            tables,
            reg,
            uc,
            label,
            name,
            mv,
            pv,
            sid,
            config.iou_threshold,
            config.bootstrap,
            events_table=CANDIDATE_EVENTS,
            scores_table=CANDIDATE_SCORES,
        )
    (prow, _), (crow, _) = results["production"], results["challenger"]
    every = videos.get_column("video_id").to_list()
    answers = [
        candidate_predictions(tables, uc, mv, pv, structurer_id(structurer, name, mv), every, CANDIDATE_EVENTS)
        for mv, pv, _, _ in candidates.values()
    ]
    gate = paired_gate(
        golden,
        *answers,
        tolerance=config.tolerance,
        metrics=config.metrics,
        confidence=config.confidence,
        n_boot=config.bootstrap,
        min_videos=config.min_videos,
        iou_threshold=config.iou_threshold,
    )
    forced = gate["decision"] == UNDECIDED and config.force
    promoted = gate["decision"] == PROMOTE or forced
    reason = gate["reason"] + ("; promoted anyway: force" if forced else "")
    context.log.info(reason)
    decision = {
        "decision_id": uuid.uuid4().hex[:16],
        "decided_at": datetime.now(UTC),
        "use_case": uc.name,
        "production_model_version": pm,
        "production_prompt_version": int(pp),
        "challenger_model_version": cm or pm,
        "challenger_prompt_version": int(cp or pp),
        "promoted": promoted,
        "reason": reason,
        "tolerance": config.tolerance,
        "production_eval_id": prow["eval_id"],
        "challenger_eval_id": crow["eval_id"],
        "gate": gate["decision"],
        "forced": forced,
        "confidence": config.confidence,
        "golden_videos": gate["videos"],
        "intervals": json.dumps(gate["intervals"]),
    }
    expected = {g["video_id"]: g["verdict"] for g in golden}
    compared = [
        {"video_id": v, "uri": u, "sample": "golden" if v in expected else "shadow", "expected": expected.get(v)}
        for v, u in videos.select("video_id", "uri").iter_rows()
    ]
    stamp = {
        "decision_id": decision["decision_id"],
        "use_case": uc.name,
        "model_version": pm,
        "prompt_version": int(pp),
        "use_case_version": uc.version,
        "structurer": structurer_id(structurer, name, pm),
        "challenger_model_version": cm or pm,
        "challenger_prompt_version": int(cp or pp),
        "diffed_at": decision["decided_at"],
    }
    diffs = [{**r, **stamp} for r in fact_diff(compared, *answers, config.iou_threshold)]
    flips = counts(diffs)
    context.log.info("fact diff: " + ", ".join(f"{k} {n}" for k, n in flips.items()))
    # The diff and the decision are recorded before any alias moves: production never changes without rows
    # saying why and what. A failure after this leaves the challenger alias in place: a rerun decides again.
    tables.merge(PROMOTION_DIFFS, to_arrow(PROMOTION_DIFFS, diffs), KEYS[PROMOTION_DIFFS])
    tables.merge(PROMOTIONS, to_arrow(PROMOTIONS, [decision]), KEYS[PROMOTIONS])
    if promoted:
        if cm:
            reg.set_alias("model", name, vlm.alias, cm)
        if cp:
            reg.set_alias("prompt", CAPTION_PROMPT_NAME, vlm.alias, cp)
        report_production(context.instance, vlm.alias, decision["decision_id"], cm, cp)
    # Undecided (too few labelled videos): the challenger stays, for a run with more labels or force.
    if gate["decision"] == UNDECIDED and not forced:
        cm = cp = None
    # Decided, the challenger has had its evaluation: the alias is cleared, the verdict kept as a tag.
    if cm:
        reg.client().set_model_version_tag(name, cm, "promotion", reason[:500])
        reg.delete_alias("model", name, CHALLENGER)
    if cp:
        reg.delete_alias("prompt", CAPTION_PROMPT_NAME, CHALLENGER)
    for table in (CANDIDATE_CAPTIONS, CANDIDATE_EVENTS):
        rows = tables.read(table, SCHEMAS[table]).filter(pl.col("video_id").is_in(videos.get_column("video_id")))
        yield MaterializeResult(asset_key=table, metadata=table_metadata(tables.table_uri(table), rows, rows.height))
    scored = tables.read(CANDIDATE_SCORES, SCHEMAS[CANDIDATE_SCORES])
    yield MaterializeResult(
        asset_key=CANDIDATE_SCORES,
        metadata={
            **table_metadata(
                tables.table_uri(CANDIDATE_SCORES),
                scored.filter(pl.col("eval_id").is_in([prow["eval_id"], crow["eval_id"]])),
                scored.height,
                ["candidate", "model_version", "prompt_version", *config.metrics],
            ),
            **{f"{label}/mlflow_run_id": MetadataValue.text(r[0]["mlflow_run_id"]) for label, r in results.items()},
        },
    )
    yield MaterializeResult(
        asset_key=PROMOTION_DIFFS,
        metadata={
            "decision_id": MetadataValue.text(decision["decision_id"]),
            "videos_compared": MetadataValue.int(len(diffs)),
            "shadow_videos": MetadataValue.int(len(shadow)),
            "changes": MetadataValue.json(flips),
            "flips": MetadataValue.md(_flips_table(diffs, alert_delivery.service_url)),
        },
    )
    out = tables.read(PROMOTIONS, SCHEMAS[PROMOTIONS])
    now_model, now_prompt = (
        reg.alias_version("model", name, vlm.alias),
        reg.alias_version("prompt", CAPTION_PROMPT_NAME, vlm.alias),
    )
    yield MaterializeResult(
        asset_key=PROMOTIONS,
        data_version=DataVersion(decision["decision_id"]),
        metadata={
            **table_metadata(
                tables.table_uri(PROMOTIONS),
                out.filter(pl.col("decision_id") == decision["decision_id"]),
                out.height,
                ["use_case", "promoted", "reason"],
            ),
            "decision_id": MetadataValue.text(decision["decision_id"]),
            "promoted": MetadataValue.bool(promoted),
            "gate": MetadataValue.text(gate["decision"]),
            "reason": MetadataValue.text(reason),
            "intervals": MetadataValue.json(gate["intervals"]),
            "production": MetadataValue.json({m: round(prow[m], 4) for m in config.metrics}),
            "challenger": MetadataValue.json({m: round(crow[m], 4) for m in config.metrics}),
            "production_now": MetadataValue.text(f"model v{now_model}, prompt v{now_prompt}"),
        },
    )
