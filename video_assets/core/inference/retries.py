"""How every engine stage (transformers and vLLM captions, vLLM structuring, the archive models) treats an
engine that dies under a batch: the actor always comes back, the batch is tried a bounded number of times
and then dropped, and the job goes on; its consumer turns what is missing into error rows."""

from __future__ import annotations

# A batch whose engine died under it is sent again this many times, then dropped (its rows become errors).
VLM_BATCH_RETRIES = 2
NO_RESULT = "no result: the engine died on this segment's batch on every try, or its worker was lost (see the Ray logs)"


def engine_stage_options() -> dict[str, int]:
    """Ray options of every engine actor pool (transformers, vLLM, the archive models). ``max_restarts``
    stays unbounded: once a bounded count is spent Ray Data's pool waits on the dead actor forever
    (measured: 'restarting=1' and no progress), so the bound is on the batch instead."""
    return {"max_restarts": -1, "max_task_retries": VLM_BATCH_RETRIES}


# How long a job's actor pools may take to start every actor they were sized for (a model load each, a GPU node
# scaled up, a model fetched onto it) before the job fails saying the cluster lacks the resources.
ENGINES_START_TIMEOUT_S = 1800


def all_engines_first(ds, engines: int):
    """With more than one engine: process no row until every actor of the job's fixed pools is up (Ray Data's
    ``wait_for_min_actors_s``): an 8-engine pool captions on 8 GPUs from its first batch, not on those placed
    by then while the others load; a pool that cannot start in ``ENGINES_START_TIMEOUT_S`` fails the job (too
    few GPUs) instead of waiting silently. One engine: nothing to wait for (the first row needs it anyway),
    and decoding overlaps its model load. Set on this dataset's own context, not the process's."""
    if engines > 1:
        ds.context.wait_for_min_actors_s = ENGINES_START_TIMEOUT_S
    return ds


def tolerate_failed_batches(ds):
    """Let the job finish when a batch failed on every try (Ray Data drops it and logs why) instead of
    failing every other video's captions with it. Set on this dataset's own context, not the process's."""
    ds.context.max_errored_blocks = -1
    return ds
