"""Periodic work: Delta table maintenance (compact + vacuum with a safe retention) and evaluation."""

from dagster import (
    AssetSelection,
    AutomationConditionSensorDefinition,
    DefaultSensorStatus,
    Config,
    DefaultScheduleStatus,
    OpExecutionContext,
    ScheduleDefinition,
    job,
    op,
)
from pydantic import Field

from resources.delta import DeltaTables
from video_assets.jobs import evaluate_job
from video_assets.tables import SCHEMAS


class MaintenanceConfig(Config):
    retention_hours: int = Field(default=168, ge=0, description="Keep unreferenced files this long (time travel)")


@op(description="Compact and vacuum every table of the product.")
def maintain_tables(context: OpExecutionContext, config: MaintenanceConfig, tables: DeltaTables) -> list[dict]:
    results = []
    for name in SCHEMAS:
        result = tables.maintain(name, config.retention_hours)
        context.log.info(f"{name}: {result}")
        results.append(result)
    return results


@job(description="Delta maintenance for all tables; safe to run while batches run (delta-rs retries conflicts).")
def table_maintenance():
    maintain_tables()


table_maintenance_schedule = ScheduleDefinition(
    job=table_maintenance,
    cron_schedule="0 3 * * *",
    default_status=DefaultScheduleStatus.STOPPED,
    description="Nightly at 03:00 UTC; stopped by default, switch it on in the UI.",
)


evaluation_schedule = ScheduleDefinition(
    name="evaluation_schedule",
    job=evaluate_job,
    cron_schedule="0 4 * * *",
    default_status=DefaultScheduleStatus.STOPPED,
    description="Daily at 04:00 UTC (after maintenance): golden_set + eval_scores of the production model "
    "and prompt; stopped by default, switch it on in the UI.",
)


# Declarative automation for the evaluation group (eval_scores is eager). Per-batch assets are not
# automated: the upload sensor's run already covers all of them.
evaluation_automation = AutomationConditionSensorDefinition(
    "evaluation_automation",
    target=AssetSelection.groups("evaluation"),
    default_status=DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=60,
    description="Re-scores eval_scores once new structured events (or labels) land and no batch is "
    "in progress; stopped by default (evaluation_schedule is the nightly alternative).",
)
