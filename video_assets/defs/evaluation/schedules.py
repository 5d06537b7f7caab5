"""Nightly evaluation (stopped by default)."""

from dagster import DefaultScheduleStatus, ScheduleDefinition

from video_assets.defs.evaluation.jobs import evaluate_job

evaluation_schedule = ScheduleDefinition(
    name="evaluation_schedule",
    job=evaluate_job,
    cron_schedule="0 4 * * *",
    default_status=DefaultScheduleStatus.STOPPED,
    description="Daily at 04:00 UTC (after maintenance): golden_set + eval_scores of the production model "
    "and prompt; stopped by default, switch it on in the UI.",
)
