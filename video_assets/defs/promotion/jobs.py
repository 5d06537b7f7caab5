"""The promotion stage's job."""

from dagster import AssetSelection, define_asset_job

from video_assets.defs.promotion.assets import promotion

promote_challenger_job = define_asset_job(
    name="promote_challenger",
    selection=AssetSelection.assets(promotion),
    description="Evaluate the challenger model/prompt against production on a golden set and promote it only "
    "if it does not regress.",
    tags={"video/kind": "promotion"},
)
