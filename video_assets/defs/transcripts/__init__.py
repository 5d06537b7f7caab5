"""Transcripts: speech segments with word times per video, from Whisper, one Ray Data job per batch."""

from dagster import Definitions

from video_assets.core.tables import TRANSCRIPTS
from video_assets.defs.common import table_checks
from video_assets.defs.transcripts.assets import transcripts

defs = Definitions(assets=[transcripts], asset_checks=[table_checks(TRANSCRIPTS)])
