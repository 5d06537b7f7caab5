"""Delivery: new alerts to the configured webhooks, once each (a sensor)."""

from dagster import Definitions

from video_assets.defs.delivery.assets import alert_deliveries
from video_assets.defs.delivery.sensors import alert_delivery_sensor

defs = Definitions(assets=[alert_deliveries], sensors=[alert_delivery_sensor])
