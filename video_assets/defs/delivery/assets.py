"""Delivery's table: ``alert_deliveries``, written by the delivery sensor (``sensors.py``), outside any run."""

from dagster import AssetSpec

from video_assets.core.tables import ALERT_DELIVERIES, ALERTS
from video_assets.defs.common import stage_asset

# A tick that wrote rows reports a materialisation of it (``sensors.alert_delivery_sensor``).
alert_deliveries = AssetSpec(
    ALERT_DELIVERIES,
    deps=[ALERTS],
    **stage_asset("delivery", ALERT_DELIVERIES),
    description="Every attempt to post an alert to a webhook (status, error, next try), written by "
    "alert_delivery_sensor after each answer.",
)
