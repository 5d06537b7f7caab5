"""Evaluation stage assets: golden_set (the person-written labels of every use case) and eval_scores
(structured_events of the model and prompt they were last structured with, vs the golden set, per use case), each
evaluation logged as an MLflow run."""

import polars as pl
from dagster import (
    AssetExecutionContext,
    AssetSpec,
    AutomationCondition,
    Config,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core.charts import markdown_image
from video_assets.core.evaluation.golden import golden_rows as label_rows
from video_assets.core.evaluation.golden import label_files, load_labels
from video_assets.core.previews import markdown_table
from video_assets.core.review.labels import REVIEWED, golden_with_reviews, labels_outside_clips
from video_assets.core.tables import (
    EVAL_SCORES,
    GOLDEN_SET,
    REVIEW_LABELS,
    SCHEMAS,
    STRUCTURED_EVENTS,
    VIDEO_METADATA,
    to_arrow,
)
from video_assets.defs.common import TRANSIENT_RETRY, stage_asset, table_metadata
from video_assets.defs.lineage import structurer_id, upstream_pair
from video_assets.defs.scoring import evaluate_candidate

# Written by the review page (`video-assets serve`, /review), outside any run: each save is reported as a
# materialisation of this asset (service/review.py), so golden_set shows as stale until it runs again.
review_labels = AssetSpec(
    REVIEW_LABELS,
    **stage_asset("evaluation", REVIEW_LABELS),
    description="Labels people saved on the review page, a row each (the latest per video wins in golden_set).",
)


# Idempotent (the current label files replace the use cases' rows in one commit): retried on transient errors.
@asset(
    **stage_asset("evaluation", GOLDEN_SET),
    deps=[review_labels],
    retry_policy=TRANSIENT_RETRY,
    description="Person-written labels of every use case (video_assets/usecases/<name>/golden.jsonl) plus "
    "the review page's labels (review_labels: the latest per video wins over a shipped label and says so), "
    "matched to videos by content hash; the labels_version hashes the file and the reviewed labels.",
)
def golden_set(context: AssetExecutionContext, tables: DeltaTables) -> MaterializeResult:
    rows, versions, conflicts = [], {}, []
    reviewed = tables.read(REVIEW_LABELS, SCHEMAS[REVIEW_LABELS]).to_dicts()
    # A label whose events fall outside its clip (saved before the service checked) never replaces one.
    videos = sorted({r["video_id"] for r in reviewed})
    meta = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA], where=pl.col("video_id").is_in(videos))
    outside = labels_outside_clips(reviewed, dict(meta.select("video_id", "duration_s").iter_rows()))
    for label_id, why in sorted(outside.items()):
        context.log.warning(f"review label {label_id} not used: {why}")
    reviewed = [r for r in reviewed if r["label_id"] not in outside]
    for use_case, path in label_files().items():
        try:
            records, shipped_version = load_labels(path)
        except ValueError as exc:
            raise Failure(str(exc), allow_retries=False) from exc
        merged = golden_with_reviews(
            use_case, label_rows(use_case, records, shipped_version), shipped_version, reviewed
        )
        version = merged[0]["labels_version"] if merged else shipped_version
        versions[use_case] = version
        rows += merged
        conflicts += [{k: r[k] for k in ("use_case", "file", "verdict", "conflicts")} for r in merged if r["conflicts"]]
        n_reviewed = sum(r["source"] == REVIEWED for r in merged)
        context.log.info(
            f"{use_case}: {len(merged)} labelled videos ({n_reviewed} reviewed, "
            f"{sum(r['replaces_shipped'] for r in merged)} replacing a shipped label), labels version {version}"
        )
    # The table holds exactly the current labels (a removed record must not linger), replaced in one
    # commit so that a crash never leaves a use case without labels.
    if versions:
        tables.replace(GOLDEN_SET, to_arrow(GOLDEN_SET, rows), "use_case", sorted(versions))
    out = tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET])
    return MaterializeResult(
        data_version=DataVersion(",".join(f"{k}:{v}" for k, v in sorted(versions.items()))),
        metadata={
            **table_metadata(tables.table_uri(GOLDEN_SET), out, out.height, ["use_case", "file", "verdict"]),
            "labels_versions": MetadataValue.json(versions),
            "reviewed_labels": MetadataValue.int(int((out.get_column("source") == REVIEWED).sum())),
            # Labels of one clip that disagree: shown, never merged silently (the latest review is used).
            "label_conflicts": MetadataValue.md(
                markdown_table(pl.DataFrame(conflicts), ["use_case", "file", "verdict", "conflicts"])
            )
            if conflicts
            else MetadataValue.text("none"),
            "verdict_counts": MetadataValue.json(dict(out.group_by("verdict").len().sort("verdict").iter_rows())),
        },
    )


class EvalConfig(Config):
    iou_threshold: float = Field(default=0.3, gt=0, le=1, description="Temporal IoU for an event to match")
    bootstrap: int = Field(default=1000, ge=10, description="Bootstrap resamples for the confidence interval")


@asset(
    deps=["structured_events", golden_set],
    # Re-score once every batch's events are in and one of them (or the labels) changed.
    automation_condition=AutomationCondition.eager(),
    # No retry policy: every attempt records a new MLflow run and eval_scores row.
    **stage_asset("evaluation", EVAL_SCORES, kinds=("mlflow",)),
)
def eval_scores(
    context: AssetExecutionContext,
    config: EvalConfig,
    vlm: VlmSettings,
    structurer: StructurerSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
) -> MaterializeResult:
    """Scores of the production model + prompt on every configured use case's golden set: P/R/F1 per
    verdict and for flagged (confirmed + suspected), confusion matrix, temporal-IoU event matching,
    coverage, bootstrap CI. One eval_scores row and one MLflow run per use case (the `evaluate` job;
    its schedule `evaluation_schedule` runs it daily). The model and prompt scored are those of the
    latest structured_events materialisation (lineage, not the alias)."""
    pair = upstream_pair(context, None, STRUCTURED_EVENTS)
    model_version, prompt_version = pair.model_version, pair.prompt_version
    sid = structurer_id(structurer, vlm.registered_model, model_version)
    metadata, rows = {}, []
    for uc in structurer.use_case_list():
        row, scores = evaluate_candidate(
            tables,
            mlflow_registry,
            uc,
            "production",
            vlm.registered_model,
            model_version,
            prompt_version,
            sid,
            config.iou_threshold,
            config.bootstrap,
        )
        rows.append(row)
        m = scores["metrics"]
        context.log.info(
            f"{uc.name}: {scores['scored_videos']}/{scores['golden_videos']} golden videos scored; flagged F1 "
            f"{m['flagged_f1']:.3f} [{m['flagged_f1_ci_low']:.3f}, {m['flagged_f1_ci_high']:.3f}], coverage {m['coverage']:.3f}"
        )
        if scores["missing"]:
            context.log.warning(
                f"{uc.name}: {len(scores['missing'])} golden videos have no prediction "
                f"(not registered or not structured): {', '.join(scores['missing'][:10])}"
            )
        metadata[f"{uc.name}/confusion"] = MetadataValue.md(
            markdown_image(scores["png"], "confusion matrix")
            + "\n\n"
            + markdown_table(
                pl.DataFrame(
                    {
                        "expected": scores["confusion"]["rows"],
                        **{
                            c: [r[j] for r in scores["confusion"]["matrix"]]
                            for j, c in enumerate(scores["confusion"]["columns"])
                        },
                    }
                )
            )
        )
        metadata[f"{uc.name}/mlflow_run"] = MetadataValue.url(
            mlflow_registry.run_url(scores["experiment_id"], scores["run_id"])
        )
        for k in ("flagged_f1", "macro_f1", "event_f1", "coverage"):
            metadata[f"{uc.name}/{k}"] = MetadataValue.float(round(m[k], 4))
        metadata[f"{uc.name}/scored_videos"] = MetadataValue.int(scores["scored_videos"])
    out = pl.from_arrow(to_arrow(EVAL_SCORES, rows))
    labels = sorted({r["labels_version"] for r in rows})
    return MaterializeResult(
        data_version=DataVersion(f"model-v{model_version}-prompt-v{prompt_version}-{sid}-labels-{','.join(labels)}"),
        metadata={
            **table_metadata(
                tables.table_uri(EVAL_SCORES),
                out,
                tables.read(EVAL_SCORES).height,
                ["use_case", "model_version", "prompt_version", "flagged_f1", "macro_f1", "event_f1", "coverage"],
            ),
            **pair.metadata(),
            "mlflow_tracking_uri": MetadataValue.text(mlflow_registry.tracking_uri),
            **metadata,
        },
    )
