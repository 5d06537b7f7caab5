"""Evaluation-group assets: eval_scores (structured_events of the production model and prompt vs the
golden_set, per use case), logged as an MLflow run, with asset checks holding score floors."""

import json
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AutomationCondition,
    Config,
    Field as DagsterField,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.settings import env_value
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets import usecase as uc_mod
from video_assets.charts import confusion_png, markdown_image
from video_assets.evaluation import score_use_case, video_predictions
from video_assets.events import production_versions, structured_events, structurer_id, structuring_versions
from video_assets.golden import golden_set
from video_assets.previews import markdown_table, table_metadata
from video_assets.tables import EVAL_SCORES, GOLDEN_SET, HEADLINE_METRICS, KEYS, SCHEMAS, STRUCTURED_EVENTS, column_schema, to_arrow

EXPERIMENT = "video-assets-evaluation"


class EvalConfig(Config):
    iou_threshold: float = Field(default=0.3, gt=0, le=1, description="Temporal IoU for an event to match")
    bootstrap: int = Field(default=1000, ge=10, description="Bootstrap resamples for the confidence interval")


def golden_rows(tables: DeltaTables, use_case: str) -> list[dict]:
    return tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET]).filter(pl.col("use_case") == use_case).to_dicts()


def evaluate_candidate(
    tables: DeltaTables, registry: MlflowRegistry, uc: uc_mod.UseCase, candidate: str, model_name: str,
    model_version: str, prompt_version: int, structurer: str, iou_threshold: float, bootstrap: int,
) -> tuple[dict, dict]:
    """Score one (model, prompt, structurer) on the use case's golden set; write an eval_scores row
    and an MLflow run. Returns (row, scores)."""
    golden = golden_rows(tables, uc.name)
    if not golden:
        raise Failure(f"golden_set has no labels for use case {uc.name!r}: materialise golden_set first")
    ids = [g["video_id"] for g in golden]
    events = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS]).filter(
        structuring_versions(model_version, prompt_version, structurer, uc) & pl.col("video_id").is_in(ids)
    )
    scores = score_use_case(golden, video_predictions(events.to_dicts()), iou_threshold, bootstrap)
    png = confusion_png(scores["confusion"]["rows"], scores["confusion"]["columns"], scores["confusion"]["matrix"],
                        f"{uc.name}: model v{model_version}, prompt v{prompt_version}")
    labels_version = golden[0]["labels_version"]
    eval_id = uuid.uuid4().hex[:16]
    tags = {"use_case": uc.name, "candidate": candidate, "model_name": model_name, "model_version": model_version,
            "prompt_version": str(prompt_version), "use_case_version": uc.version, "structurer": structurer,
            "labels_version": labels_version, "eval_id": eval_id}
    import mlflow

    with registry.run(EXPERIMENT, run_name=f"{uc.name}-{candidate}-m{model_version}-p{prompt_version}", tags=tags) as run:
        mlflow.log_params({"iou_threshold": iou_threshold, "bootstrap": bootstrap,
                           "golden_videos": scores["golden_videos"], "scored_videos": scores["scored_videos"]})
        mlflow.log_metrics(scores["metrics"])
        mlflow.log_dict({"per_class": scores["per_class"], "confusion": scores["confusion"], "missing": scores["missing"]}, "scores.json")
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "confusion.png").write_bytes(png)
            mlflow.log_artifact(str(Path(tmp) / "confusion.png"))
        run_id, experiment_id = run.info.run_id, run.info.experiment_id
    row = {
        "eval_id": eval_id, "evaluated_at": datetime.now(timezone.utc), "use_case": uc.name,
        "labels_version": labels_version, "candidate": candidate, "model_version": model_version,
        "prompt_version": prompt_version, "use_case_version": uc.version, "structurer": structurer,
        "iou_threshold": iou_threshold, "golden_videos": scores["golden_videos"], "scored_videos": scores["scored_videos"],
        **{m: scores["metrics"][m] for m in HEADLINE_METRICS},
        "metrics": json.dumps(scores["metrics"], sort_keys=True), "per_class": json.dumps(scores["per_class"], sort_keys=True),
        "confusion": json.dumps(scores["confusion"]), "mlflow_run_id": run_id,
    }
    tables.merge(EVAL_SCORES, to_arrow(EVAL_SCORES, [row]), KEYS[EVAL_SCORES])
    scores.update(png=png, run_id=run_id, experiment_id=experiment_id, eval_id=eval_id)
    return row, scores


def mlflow_run_url(experiment_id: str, run_id: str) -> str:
    base = env_value("MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


@asset(
    deps=[structured_events, golden_set],
    group_name="evaluation",
    kinds={"delta", "mlflow"},
    owners=["team:video-platform"],
    code_version="1",
    # Re-score once every batch's events are in and one of them (or the labels) changed.
    automation_condition=AutomationCondition.eager(),
    metadata={"dagster/column_schema": column_schema(EVAL_SCORES)},
)
def eval_scores(
    context: AssetExecutionContext, config: EvalConfig, vlm: VlmSettings, structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry, tables: DeltaTables,
) -> MaterializeResult:
    """Scores of the production model + prompt on every configured use case's golden set: P/R/F1 per
    verdict and for flagged (confirmed + suspected), confusion matrix, temporal-IoU event matching,
    coverage, bootstrap CI. One eval_scores row and one MLflow run per use case (the `evaluate` job;
    its schedule `evaluation_schedule` runs it daily)."""
    model_version, prompt_version = production_versions(vlm, mlflow_registry)
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    metadata, rows = {}, []
    for uc in uc_mod.parse_names(structurer.use_cases):
        row, scores = evaluate_candidate(tables, mlflow_registry, uc, "production", vlm.registered_model, model_version,
                                         prompt_version, sid, config.iou_threshold, config.bootstrap)
        rows.append(row)
        m = scores["metrics"]
        context.log.info(
            f"{uc.name}: {scores['scored_videos']}/{scores['golden_videos']} golden videos scored; flagged F1 "
            f"{m['flagged_f1']:.3f} [{m['flagged_f1_ci_low']:.3f}, {m['flagged_f1_ci_high']:.3f}], coverage {m['coverage']:.3f}"
        )
        if scores["missing"]:
            context.log.warning(f"{uc.name}: {len(scores['missing'])} golden videos have no prediction "
                                f"(not registered or not structured): {', '.join(scores['missing'][:10])}")
        metadata[f"{uc.name}/confusion"] = MetadataValue.md(
            markdown_image(scores["png"], "confusion matrix") + "\n\n" + markdown_table(
                pl.DataFrame({"expected": scores["confusion"]["rows"],
                              **{c: [r[j] for r in scores["confusion"]["matrix"]] for j, c in enumerate(scores["confusion"]["columns"])}})
            )
        )
        metadata[f"{uc.name}/mlflow_run"] = MetadataValue.url(mlflow_run_url(scores["experiment_id"], scores["run_id"]))
        for k in ("flagged_f1", "macro_f1", "event_f1", "coverage"):
            metadata[f"{uc.name}/{k}"] = MetadataValue.float(round(m[k], 4))
        metadata[f"{uc.name}/scored_videos"] = MetadataValue.int(scores["scored_videos"])
    out = pl.from_arrow(to_arrow(EVAL_SCORES, rows))
    return MaterializeResult(metadata={
        **table_metadata(tables.table_uri(EVAL_SCORES), out, tables.read(EVAL_SCORES).height,
                         ["use_case", "model_version", "prompt_version", "flagged_f1", "macro_f1", "event_f1", "coverage"]),
        "model_version": MetadataValue.text(model_version),
        "prompt_version": MetadataValue.int(prompt_version),
        "mlflow_tracking_uri": MetadataValue.text(mlflow_registry.tracking_uri),
        **metadata,
    })


@asset_check(
    asset=eval_scores,
    description="The latest production scores of every use case stay at or above the floors (set in the launchpad).",
    config_schema={
        "min_flagged_f1": DagsterField(float, default_value=0.0, is_required=False),
        "min_coverage": DagsterField(float, default_value=0.9, is_required=False),
        "min_event_f1": DagsterField(float, default_value=0.0, is_required=False),
    },
)
def eval_scores_above_floors(context: AssetCheckExecutionContext, tables: DeltaTables) -> AssetCheckResult:
    floors = {"flagged_f1": context.op_execution_context.op_config["min_flagged_f1"],
              "coverage": context.op_execution_context.op_config["min_coverage"],
              "event_f1": context.op_execution_context.op_config["min_event_f1"]}
    df = tables.read(EVAL_SCORES, SCHEMAS[EVAL_SCORES]).filter(pl.col("candidate") == "production")
    latest = df.sort("evaluated_at").group_by("use_case").last()
    below = {f"{r['use_case']}.{k}": round(r[k], 4) for r in latest.to_dicts() for k, floor in floors.items() if r[k] < floor}
    return AssetCheckResult(
        passed=not below and latest.height > 0,
        severity=AssetCheckSeverity.ERROR,
        metadata={"floors": floors, "below_floor": below, "use_cases": latest.height},
    )


eval_checks = [eval_scores_above_floors]
