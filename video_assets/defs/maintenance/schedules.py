"""Nightly table maintenance (stopped by default)."""

from dagster import DefaultScheduleStatus, ScheduleDefinition

from video_assets.defs.maintenance.jobs import table_maintenance

table_maintenance_schedule = ScheduleDefinition(
    job=table_maintenance,
    cron_schedule="0 3 * * *",
    default_status=DefaultScheduleStatus.STOPPED,
    description="Nightly at 03:00 UTC; stopped by default, switch it on in the UI.",
)
