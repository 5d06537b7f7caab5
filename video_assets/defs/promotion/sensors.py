"""Starts promote_challenger when a new challenger appears (opt-in)."""

from dagster import DefaultSensorStatus, RunRequest, SensorEvaluationContext, SkipReason, sensor

from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from video_assets.defs.promotion.jobs import promote_challenger_job
from video_assets.defs.registry import CAPTION_PROMPT_NAME, CHALLENGER


@sensor(
    job=promote_challenger_job,
    minimum_interval_seconds=120,
    default_status=DefaultSensorStatus.STOPPED,
    description="Starts promote_challenger when a model or prompt version appears behind `challenger`; "
    "one run per distinct challenger pair (run_key). Stopped by default.",
)
def challenger_sensor(context: SensorEvaluationContext, vlm: VlmSettings, mlflow_registry: MlflowRegistry):
    cm = mlflow_registry.alias_version("model", vlm.registered_model, CHALLENGER)
    cp = mlflow_registry.alias_version("prompt", CAPTION_PROMPT_NAME, CHALLENGER)
    if cm is None and cp is None:
        return SkipReason("no challenger model or prompt")
    return RunRequest(
        run_key=f"model-{cm}-prompt-{cp}", tags={"video/challenger_model": str(cm), "video/challenger_prompt": str(cp)}
    )
