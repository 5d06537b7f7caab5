"""Curation: every caption frame scored, kept or dropped, kept ones stored (and optionally described);
the training export of the kept frames, and its job."""

from dagster import Definitions

from video_assets.defs.curation.assets import frames, training_export
from video_assets.defs.curation.checks import curation_checks
from video_assets.defs.curation.jobs import export_training_frames

defs = Definitions(assets=[frames, training_export], asset_checks=curation_checks, jobs=[export_training_frames])
