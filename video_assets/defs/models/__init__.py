"""Models: the captioning VLM and the caption prompt in MLflow, behind production/challenger aliases; the
archive's speech, frame and text models behind production."""

from dagster import Definitions

from video_assets.defs.models.assets import ARCHIVE_MODELS, caption_prompt, vlm_model
from video_assets.defs.models.jobs import register_model_job

defs = Definitions(assets=[vlm_model, caption_prompt, *ARCHIVE_MODELS], jobs=[register_model_job])
