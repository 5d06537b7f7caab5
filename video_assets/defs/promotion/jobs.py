"""The promotion stage's job."""

from dagster import AssetSelection, define_asset_job

promote_challenger_job = define_asset_job(
    name="promote_challenger",
    selection=AssetSelection.assets("promotion_decisions"),
    description="Evaluate the challenger model/prompt against production on a golden set and promote it only "
    "if it does not regress.",
    tags={"video/kind": "promotion"},
)
