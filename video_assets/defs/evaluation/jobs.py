"""The evaluation stage's job: load the labels, score the production model and prompt."""

from dagster import AssetSelection, define_asset_job

evaluate_job = define_asset_job(
    name="evaluate",
    selection=AssetSelection.assets("golden_set", "eval_scores"),
    description="Load the golden labels and score the production model and prompt on them (MLflow run per use case).",
)
