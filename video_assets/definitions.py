"""The one entry point: every stage's assets, checks, jobs, schedules and sensors, plus the resources."""

from __future__ import annotations

from dagster import Definitions
from dagster_ray.configs import Lifecycle

from resources.archive import FRAMES, PACKAGED, SPEECH, TEXT, ArchiveSettings
from resources.curation import CurationStore
from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from resources.llm import LlmSettings
from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import FORWARDED_ENV, EmbeddedRay
from resources.ray_service import local_ray_address, ray_init_options
from resources.search import SearchIndex
from resources.settings import (
    default_curation_dir,
    default_index_uri,
    default_mlflow_artifacts,
    default_mlflow_uri,
    default_models_dir,
    default_tables_uri,
    default_volume_uri,
    env_or,
    forward_env_names,
)
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import TINY_MODEL_SOURCE, VlmSettings
from resources.volume import VideoVolume
from video_assets.defs import (
    captioning,
    curation,
    delivery,
    embeddings,
    evaluation,
    ingest,
    maintenance,
    models,
    promotion,
    routing,
    search,
    structuring,
    summaries,
    transcripts,
)

STAGES = (
    ingest,
    models,
    captioning,
    structuring,
    routing,
    delivery,
    evaluation,
    promotion,
    transcripts,
    embeddings,
    summaries,
    search,
    curation,
    maintenance,
)


def build_resources() -> dict:
    """Resources from environment variables, with embedded defaults for a laptop."""
    return {
        "volume": VideoVolume(uri=env_or("VIDEO_VOLUME_URI", default_volume_uri())),
        "tables": DeltaTables(root_uri=env_or("VIDEO_TABLES_URI", default_tables_uri())),
        "mlflow_registry": MlflowRegistry(
            tracking_uri=env_or("MLFLOW_TRACKING_URI", default_mlflow_uri()),
            artifact_root=env_or("MLFLOW_ARTIFACT_ROOT", default_mlflow_artifacts()),
            ui_url=env_or("MLFLOW_UI_URL", "http://127.0.0.1:5000"),
        ),
        "vlm": VlmSettings(
            model_source=env_or("VLM_MODEL_SOURCE", TINY_MODEL_SOURCE),
            engine=env_or("VLM_ENGINE", "auto"),
            cache_dir=env_or("VLM_CACHE_DIR", default_models_dir()),
            endpoint_url=env_or("VLM_ENDPOINT_URL", ""),
            endpoint_model=env_or("VLM_ENDPOINT_MODEL", ""),
            endpoint_api_key=env_or("VLM_ENDPOINT_API_KEY", ""),
            endpoint_video=env_or("VLM_ENDPOINT_VIDEO", False, (VlmSettings, "endpoint_video")),
            endpoint_timeout_s=env_or("VLM_REQUEST_TIMEOUT_S", 120.0, (VlmSettings, "endpoint_timeout_s")),
            max_error_share=env_or("VLM_MAX_ERROR_SHARE", 0.5, (VlmSettings, "max_error_share")),
            # GPU sizing: what a sensor-launched run (no run config) gets on a GPU node.
            concurrency=env_or("VLM_CONCURRENCY", 1, (VlmSettings, "concurrency")),
            tensor_parallel_size=env_or("VLM_TENSOR_PARALLEL_SIZE", None, (VlmSettings, "tensor_parallel_size")),
            gpu_memory_utilization=env_or("VLM_GPU_MEMORY_UTILIZATION", None, (VlmSettings, "gpu_memory_utilization")),
            max_num_seqs=env_or("VLM_MAX_NUM_SEQS", None, (VlmSettings, "max_num_seqs")),
            accelerator_type=env_or("VLM_ACCELERATOR_TYPE", ""),
        ),
        "search_index_store": SearchIndex(uri=env_or("VIDEO_INDEX_URI", default_index_uri())),
        "archive": ArchiveSettings(
            speech_model_source=env_or("SPEECH_MODEL_SOURCE", PACKAGED[SPEECH]),
            frame_encoder_source=env_or("FRAME_ENCODER_SOURCE", PACKAGED[FRAMES]),
            text_encoder_source=env_or("TEXT_ENCODER_SOURCE", PACKAGED[TEXT]),
            device=env_or("ARCHIVE_DEVICE", "auto"),
            cache_dir=env_or("VLM_CACHE_DIR", default_models_dir()),
        ),
        "curation": CurationStore(
            frames_dir=env_or("VIDEO_CURATION_FRAMES_DIR", f"{default_curation_dir()}/frames"),
            exports_dir=env_or("VIDEO_CURATION_EXPORTS_DIR", f"{default_curation_dir()}/exports"),
        ),
        "structurer": StructurerSettings(
            use_cases=env_or("VIDEO_USE_CASES", "object_handling"),
            model=env_or("STRUCTURER_MODEL", CAPTIONER),
            engine=env_or("STRUCTURER_ENGINE", "auto"),
        ),
        # Webhooks new alerts are posted to (alert_delivery_sensor); none when unset.
        "alert_delivery": AlertDestinations(
            config_file=env_or("VIDEO_ALERT_DESTINATIONS", ""),
            service_url=env_or("VIDEO_SERVICE_URL", "http://127.0.0.1:8300"),
        ),
        # An OpenAI-compatible LLM (vLLM's server) for summaries and the ask agent; none when unset.
        "llm": LlmSettings(
            base_url=env_or("LLM_BASE_URL", ""),
            model=env_or("LLM_MODEL", ""),
            api_key=env_or("LLM_API_KEY", "EMPTY"),
        ),
        # Connects to RAY_ADDRESS when set (ray.init reads it); an embedded local Ray, with Ray's
        # token authentication on and this instance's token, otherwise.
        # Both forward the step's credentials and endpoints to every worker (FORWARDED_ENV + RAY_FORWARD_ENV).
        "ray_cluster": EmbeddedRay(
            ray_init_options=ray_init_options(),
            address=local_ray_address(),
            forward_env=forward_env_names(FORWARDED_ENV),
        ),
        # The same, connected only when a step asks (structuring starts Ray only for the vLLM engine).
        "ray_on_demand": EmbeddedRay(
            ray_init_options=ray_init_options(),
            address=local_ray_address(),
            forward_env=forward_env_names(FORWARDED_ENV),
            lifecycle=Lifecycle(connect=False),
        ),
    }


defs = Definitions.merge(*(stage.defs for stage in STAGES), Definitions(resources=build_resources()))
