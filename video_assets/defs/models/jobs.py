"""The models stage's job: register the captioning model and prompt (idempotent)."""

from dagster import AssetSelection, define_asset_job

register_model_job = define_asset_job(
    name="register_model",
    selection=AssetSelection.assets("vlm_model", "caption_prompt"),
    description="Register the captioning model and prompt in MLflow behind their alias (idempotent).",
)
