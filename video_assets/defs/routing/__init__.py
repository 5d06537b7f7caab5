"""Routing: structured rows -> alerts or the human review queue."""

from dagster import Definitions

from video_assets.defs.routing.assets import routed_events
from video_assets.defs.routing.checks import routing_checks

defs = Definitions(assets=[routed_events], asset_checks=routing_checks)
