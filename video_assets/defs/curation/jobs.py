"""export_training_frames: materialise training_export (the job the CLI and docs name)."""

from dagster import define_asset_job

export_training_frames = define_asset_job(
    "export_training_frames",
    selection=["training_export"],
    description="The kept frames of one frames table version as Parquet shards with a manifest.",
)
