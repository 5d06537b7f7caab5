"""Models: the captioning VLM and the caption prompt in MLflow, behind production/challenger aliases."""

from dagster import Definitions

from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.models.jobs import register_model_job

defs = Definitions(assets=[vlm_model, caption_prompt], jobs=[register_model_job])
