"""The job every upload batch runs: all per-batch assets of every stage, for one partition."""

from dagster import AssetSelection, define_asset_job, multiprocess_executor

# Steps still run in their own processes (a model load or a crash stays inside its step), but forked
# from a server that has already imported the code location: 6-10 s less per step.
forkserver_executor = multiprocess_executor.configured(
    {"start_method": {"forkserver": {"preload_modules": ["video_assets.definitions"]}}}
)

# Every per-batch asset downstream of the registry; later stages join this selection by being
# partitioned by video_batches and depending on it.
# (Evaluation, promotion and the training export read every batch at once: they are not part of a
# batch's run.)
per_batch_assets = (
    AssetSelection.assets("raw_videos").downstream().required_multi_asset_neighbors()
    - AssetSelection.groups("evaluation", "promotion")
    - AssetSelection.assets("training_export")
)

batch_pipeline_job = define_asset_job(
    name="batch_pipeline",
    selection=per_batch_assets,
    executor_def=forkserver_executor,
    description="Everything one upload batch needs, from registration to the last per-batch table.",
)
