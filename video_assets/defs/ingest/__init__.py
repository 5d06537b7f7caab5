"""Ingest: uploads become batches (sensor, manifest), registered videos and their probed metadata."""

from dagster import Definitions

from video_assets.defs.ingest.assets import batch_manifest, raw_videos, stream_segments, video_metadata
from video_assets.defs.ingest.checks import ingest_checks
from video_assets.defs.ingest.jobs import batch_pipeline_job
from video_assets.defs.ingest.sensors import stream_sensor, upload_sensor

defs = Definitions(
    assets=[stream_segments, batch_manifest, raw_videos, video_metadata],
    asset_checks=ingest_checks,
    jobs=[batch_pipeline_job],
    sensors=[upload_sensor, stream_sensor],
)
