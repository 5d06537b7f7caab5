"""Evaluation: golden labels and the production model's scores on them (MLflow runs)."""

from dagster import Definitions

from video_assets.defs.evaluation.assets import eval_scores, golden_set, review_labels
from video_assets.defs.evaluation.checks import evaluation_checks
from video_assets.defs.evaluation.jobs import evaluate_job
from video_assets.defs.evaluation.schedules import evaluation_schedule
from video_assets.defs.evaluation.sensors import evaluation_automation

defs = Definitions(
    assets=[review_labels, golden_set, eval_scores],
    asset_checks=evaluation_checks,
    jobs=[evaluate_job],
    schedules=[evaluation_schedule],
    sensors=[evaluation_automation],
)
