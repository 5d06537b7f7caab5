"""Promotion: a challenger model/prompt replaces production only when the golden set says so."""

from dagster import Definitions

from video_assets.defs.promotion.assets import promotion
from video_assets.defs.promotion.checks import promotion_checks
from video_assets.defs.promotion.jobs import promote_challenger_job
from video_assets.defs.promotion.sensors import challenger_sensor

defs = Definitions(
    assets=[promotion],
    asset_checks=promotion_checks,
    jobs=[promote_challenger_job],
    sensors=[challenger_sensor],
)
