"""Summaries: what happens in each video, from its captions, speech and events (extractive, or by an LLM)."""

from dagster import Definitions

from video_assets.core.tables import VIDEO_SUMMARIES
from video_assets.defs.common import table_checks
from video_assets.defs.summaries.assets import video_summaries

defs = Definitions(assets=[video_summaries], asset_checks=[table_checks(VIDEO_SUMMARIES)])
