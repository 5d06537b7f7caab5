"""The models stage's job: register the captioning model and prompt, and the archive's models (idempotent)."""

from dagster import AssetSelection, define_asset_job

register_model_job = define_asset_job(
    name="register_model",
    selection=AssetSelection.groups("models"),
    description="Register the captioning model and prompt, and the speech, frame and text models, in MLflow "
    "behind their alias (idempotent).",
)
