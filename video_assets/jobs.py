from dagster import AssetSelection, define_asset_job

# Every per-batch asset downstream of the registry; later stages join this selection by being
# partitioned by video_batches and depending on it.
# (The evaluation group reads every batch at once: it is not part of a batch's run.)
per_batch_assets = (
    AssetSelection.assets("raw_videos").downstream().required_multi_asset_neighbors() - AssetSelection.groups("evaluation")
)

batch_pipeline_job = define_asset_job(
    name="batch_pipeline",
    selection=per_batch_assets,
    description="Everything one upload batch needs, from registration to the last per-batch table.",
)

register_model_job = define_asset_job(
    name="register_model",
    selection=AssetSelection.assets("vlm_model", "caption_prompt"),
    description="Register the captioning model and prompt in MLflow behind their alias (idempotent).",
)

evaluate_job = define_asset_job(
    name="evaluate",
    selection=AssetSelection.assets("golden_set", "eval_scores"),
    description="Load the golden labels and score the production model and prompt on them (MLflow run per use case).",
)
