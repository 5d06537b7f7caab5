"""The one entry point: every asset, check, job, sensor and resource of the product."""

from __future__ import annotations

from dagster import Definitions

from dagster_ray import LocalRay

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.settings import (
    default_mlflow_artifacts,
    default_mlflow_uri,
    default_models_dir,
    default_tables_uri,
    default_volume_uri,
    env_or,
    ray_init_options,
)
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import TINY_MODEL_SOURCE, VlmSettings
from resources.volume import VideoVolume
from video_assets.captions import captions
from video_assets.checks import caption_checks, event_checks, ingest_checks
from video_assets.evaluate import eval_checks, eval_scores
from video_assets.events import routed_events, structured_events
from video_assets.golden import golden_set
from video_assets.ingest import raw_videos, video_metadata
from video_assets.jobs import batch_pipeline_job, evaluate_job, register_model_job
from video_assets.model import caption_prompt, vlm_model
from video_assets.promotion import challenger_sensor, promote_challenger_job
from video_assets.schedules import evaluation_automation, evaluation_schedule, table_maintenance, table_maintenance_schedule
from video_assets.sensors import upload_sensor


def build_resources() -> dict:
    """Resources from environment variables, with embedded defaults for a laptop."""
    return {
        "volume": VideoVolume(uri=env_or("VIDEO_VOLUME_URI", default_volume_uri())),
        "tables": DeltaTables(root_uri=env_or("VIDEO_TABLES_URI", default_tables_uri())),
        "mlflow_registry": MlflowRegistry(
            tracking_uri=env_or("MLFLOW_TRACKING_URI", default_mlflow_uri()),
            artifact_root=env_or("MLFLOW_ARTIFACT_ROOT", default_mlflow_artifacts()),
        ),
        "vlm": VlmSettings(
            model_source=env_or("VLM_MODEL_SOURCE", TINY_MODEL_SOURCE),
            engine=env_or("VLM_ENGINE", "auto"),
            cache_dir=env_or("VLM_CACHE_DIR", default_models_dir()),
        ),
        "structurer": StructurerSettings(
            use_cases=env_or("VIDEO_USE_CASES", "object_handling"),
            model=env_or("STRUCTURER_MODEL", CAPTIONER),
            engine=env_or("STRUCTURER_ENGINE", "auto"),
        ),
        # Connects to RAY_ADDRESS when set (ray.init reads it); an embedded local Ray otherwise.
        "ray_cluster": LocalRay(ray_init_options=ray_init_options()),
    }


defs = Definitions(
    assets=[raw_videos, video_metadata, vlm_model, caption_prompt, captions, structured_events, routed_events, golden_set, eval_scores],
    asset_checks=[*ingest_checks, *caption_checks, *event_checks, *eval_checks],
    jobs=[batch_pipeline_job, register_model_job, evaluate_job, table_maintenance, promote_challenger_job],
    schedules=[table_maintenance_schedule, evaluation_schedule],
    sensors=[upload_sensor, evaluation_automation, challenger_sensor],
    resources=build_resources(),
)
