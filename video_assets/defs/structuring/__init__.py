"""Structuring: caption prose -> schema-conforming event rows per use case."""

from dagster import Definitions

from video_assets.defs.structuring.assets import structured_events
from video_assets.defs.structuring.checks import structuring_checks

defs = Definitions(assets=[structured_events], asset_checks=structuring_checks)
