"""Captioning: timestamped prose per video segment from the VLM, one Ray Data job per batch."""

from dagster import Definitions

from video_assets.defs.captioning.assets import captions, sampled_frames
from video_assets.defs.captioning.checks import captioning_checks

defs = Definitions(assets=[captions, sampled_frames], asset_checks=captioning_checks)
