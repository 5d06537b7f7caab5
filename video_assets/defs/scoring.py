"""Scoring one candidate (model, prompt, structurer) on a use case's golden set: an eval_scores row
and an MLflow run. Shared by the eval_scores asset and the promotion job (which scores its candidates'
own tables)."""

import json
import uuid
from datetime import UTC, datetime

import polars as pl
from dagster import Failure

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from video_assets.core.charts import confusion_png
from video_assets.core.evaluation.metrics import score_use_case, video_predictions
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.versions import structuring_versions
from video_assets.core.tables import (
    EVAL_SCORES,
    HEADLINE_METRICS,
    KEYS,
    SCHEMAS,
    STRUCTURED_EVENTS,
    to_arrow,
)
from video_assets.defs.lineage import golden_rows

EXPERIMENT = "video-assets-evaluation"


def candidate_predictions(
    tables: DeltaTables,
    uc: uc_mod.UseCase,
    model_version: str,
    prompt_version: int,
    structurer: str,
    video_ids: list[str],
    events_table: str = STRUCTURED_EVENTS,
) -> dict[str, dict]:
    """One candidate's prediction per video (``metrics.video_predictions``) from its structured rows."""
    events = tables.read(events_table, SCHEMAS[events_table]).filter(
        structuring_versions(model_version, prompt_version, structurer, uc) & pl.col("video_id").is_in(video_ids)
    )
    return video_predictions(events.to_dicts())


def evaluate_candidate(
    tables: DeltaTables,
    registry: MlflowRegistry,
    uc: uc_mod.UseCase,
    candidate: str,
    model_name: str,
    model_version: str,
    prompt_version: int,
    structurer: str,
    iou_threshold: float,
    bootstrap: int,
    events_table: str = STRUCTURED_EVENTS,
    scores_table: str = EVAL_SCORES,
) -> tuple[dict, dict]:
    """Score one (model, prompt, structurer) on the use case's golden set; write an eval_scores row
    and an MLflow run. Returns (row, scores)."""
    golden = golden_rows(tables, uc.name)
    if not golden:
        raise Failure(f"golden_set has no labels for use case {uc.name!r}: materialise golden_set first")
    ids = [g["video_id"] for g in golden]
    predictions = candidate_predictions(tables, uc, model_version, prompt_version, structurer, ids, events_table)
    scores = score_use_case(golden, predictions, iou_threshold, bootstrap)
    png = confusion_png(
        scores["confusion"]["rows"],
        scores["confusion"]["columns"],
        scores["confusion"]["matrix"],
        f"{uc.name}: model v{model_version}, prompt v{prompt_version}",
    )
    labels_version = golden[0]["labels_version"]
    eval_id = uuid.uuid4().hex[:16]
    tags = {
        "use_case": uc.name,
        "candidate": candidate,
        "model_name": model_name,
        "model_version": model_version,
        "prompt_version": str(prompt_version),
        "use_case_version": uc.version,
        "structurer": structurer,
        "labels_version": labels_version,
        "eval_id": eval_id,
    }
    with registry.run(
        EXPERIMENT, run_name=f"{uc.name}-{candidate}-m{model_version}-p{prompt_version}", tags=tags
    ) as run:
        run_id, experiment_id = run.info.run_id, run.info.experiment_id
        registry.log_scores(
            run_id,
            params={
                "iou_threshold": iou_threshold,
                "bootstrap": bootstrap,
                "golden_videos": scores["golden_videos"],
                "scored_videos": scores["scored_videos"],
            },
            metrics=scores["metrics"],
            documents={
                "scores.json": {
                    "per_class": scores["per_class"],
                    "confusion": scores["confusion"],
                    "missing": scores["missing"],
                }
            },
            files={"confusion.png": png},
        )
    row = {
        "eval_id": eval_id,
        "evaluated_at": datetime.now(UTC),
        "use_case": uc.name,
        "labels_version": labels_version,
        "candidate": candidate,
        "model_version": model_version,
        "prompt_version": prompt_version,
        "use_case_version": uc.version,
        "structurer": structurer,
        "iou_threshold": iou_threshold,
        "golden_videos": scores["golden_videos"],
        "scored_videos": scores["scored_videos"],
        **{m: scores["metrics"][m] for m in HEADLINE_METRICS},
        "metrics": json.dumps(scores["metrics"], sort_keys=True),
        "per_class": json.dumps(scores["per_class"], sort_keys=True),
        "confusion": json.dumps(scores["confusion"]),
        "mlflow_run_id": run_id,
    }
    tables.merge(scores_table, to_arrow(scores_table, [row]), KEYS[scores_table])
    scores.update(png=png, run_id=run_id, experiment_id=experiment_id, eval_id=eval_id)
    return row, scores
