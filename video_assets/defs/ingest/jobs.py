"""The job every upload batch runs: all per-batch assets of every stage, for one partition."""

from dagster import AssetSelection, define_asset_job, multiprocess_executor

from resources.settings import batch_max_runtime_s
from video_assets.defs.common import PER_BATCH_TAG

# Steps still run in their own processes (a model load or a crash stays inside its step), but forked
# from a server that has already imported the code location: 6-10 s less per step. The server dies with the
# run process (resources/forkserver.py).
forkserver_executor = multiprocess_executor.configured(
    {"start_method": {"forkserver": {"preload_modules": ["resources.forkserver", "video_assets.definitions"]}}}
)

# Every per-batch asset: the ones batch_asset defines (partitioned by video_batches), found by the tag it
# sets. (Evaluation, promotion and the training export read every batch at once: not part of a batch's run.)
per_batch_assets = AssetSelection.tag(*PER_BATCH_TAG)

batch_pipeline_job = define_asset_job(
    name="batch_pipeline",
    selection=per_batch_assets,
    executor_def=forkserver_executor,
    description="Everything one upload batch needs, from registration to the last per-batch table.",
    # Dagster's run monitoring (the daemon) cancels a run past it: a stalled engine cannot hold a batch forever.
    tags={"dagster/max_runtime": str(limit)} if (limit := batch_max_runtime_s()) else None,
)
