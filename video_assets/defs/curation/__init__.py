"""Curation: every caption frame scored, kept or dropped, kept ones stored (and optionally described);
the training-frame export job."""

from dagster import Definitions

from video_assets.defs.curation.assets import frames
from video_assets.defs.curation.checks import curation_checks
from video_assets.defs.curation.jobs import export_training_frames

defs = Definitions(assets=[frames], asset_checks=curation_checks, jobs=[export_training_frames])
