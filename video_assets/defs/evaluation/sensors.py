"""Declarative automation of the evaluation stage (eval_scores is eager). Per-batch assets are not
automated: the upload sensor's run already covers all of them."""

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus

evaluation_automation = AutomationConditionSensorDefinition(
    "evaluation_automation",
    target=AssetSelection.groups("evaluation"),
    default_status=DefaultSensorStatus.STOPPED,
    minimum_interval_seconds=60,
    description="Re-scores eval_scores once new structured events (or labels) land and no batch is "
    "in progress; stopped by default (evaluation_schedule is the nightly alternative).",
)
