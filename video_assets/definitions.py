"""The one entry point: every asset, check, job, sensor and resource of the product."""

from __future__ import annotations

from dagster import Definitions

from resources.delta import DeltaTables
from resources.settings import default_tables_uri, default_volume_uri, env_or
from resources.volume import VideoVolume
from video_assets.checks import ingest_checks
from video_assets.ingest import raw_videos, video_metadata
from video_assets.jobs import batch_pipeline_job
from video_assets.sensors import upload_sensor


def build_resources() -> dict:
    """Resources from environment variables, with embedded defaults for a laptop."""
    return {
        "volume": VideoVolume(uri=env_or("VIDEO_VOLUME_URI", default_volume_uri())),
        "tables": DeltaTables(root_uri=env_or("VIDEO_TABLES_URI", default_tables_uri())),
    }


defs = Definitions(
    assets=[raw_videos, video_metadata],
    asset_checks=ingest_checks,
    jobs=[batch_pipeline_job],
    sensors=[upload_sensor],
    resources=build_resources(),
)
