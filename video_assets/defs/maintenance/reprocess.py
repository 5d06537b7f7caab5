"""Reprocess only what changed: after ``production`` moves, the batches whose rows came from the old model,
prompt or structuring (``core.staleness``, read from the tables themselves) are run again, each through
exactly the per-batch assets downstream of what changed (``captions`` for a model or caption-prompt change,
``structured_events`` for a structuring change) that the batch had materialised, and nothing else:
``raw_videos``, ``video_metadata`` and ``transcripts`` are never touched. Consecutive batches with the same
assets are one run (a partition range: every per-batch asset takes the range in one step, as a single-run
backfill does). ``video-assets reprocess --dry-run`` lists the plan; a second reprocess finds nothing.
"""

from __future__ import annotations

from dagster import AssetKey, AssetSelection, DagsterInstance, DagsterRunStatus, RunsFilter

from video_assets.core.staleness import stale_batches
from video_assets.core.tables import CAPTIONS, SCHEMAS, STRUCTURED_EVENTS
from video_assets.defs.common import PER_BATCH_TAG
from video_assets.defs.lineage import structurer_id
from video_assets.defs.partitions import consecutive_ranges
from video_assets.defs.registry import CAPTION_PROMPT_NAME


def reprocess_plan(instance: DagsterInstance, graph, tables, registry, vlm, structurer) -> list[dict]:
    """``[{"batch", "root", "videos", "reason", "assets"}]``: each stale batch and the per-batch assets to
    run for it (those downstream of its root that it had materialised, the root included), in batch order."""
    mv = registry.alias_version("model", vlm.registered_model, vlm.alias)
    pv = registry.alias_version("prompt", CAPTION_PROMPT_NAME, vlm.alias)
    if mv is None or pv is None:
        return []
    cols = ["batch_key", "video_id", "model_version", "prompt_version"]
    captions = tables.read(CAPTIONS, SCHEMAS[CAPTIONS]).select(cols)
    structured = tables.read(STRUCTURED_EVENTS, SCHEMAS[STRUCTURED_EVENTS]).select(
        [*cols, "use_case", "use_case_version", "structurer"]
    )
    current = [
        (uc.name, uc.version, structurer_id(structurer, vlm.registered_model, mv)) for uc in structurer.use_case_list()
    ]
    stale = stale_batches(captions, structured, mv, int(pv), current)
    done: dict[AssetKey, set[str]] = {}
    plan = []
    for batch, info in stale.items():
        keys = (AssetSelection.assets(info["root"]).downstream() & AssetSelection.tag(*PER_BATCH_TAG)).resolve(graph)
        for key in keys:
            if key not in done:
                done[key] = set(instance.get_materialized_partitions(key))
        chosen = sorted(k.to_user_string() for k in keys if batch in done[k] or k.to_user_string() == info["root"])
        plan.append({"batch": batch, **info, "assets": chosen})
    return plan


def runs(order: list[str], plan: list[dict]) -> list[dict]:
    """The plan as runs: consecutive batches (in ``order``, the partitions') with the same assets together."""
    out: list[dict] = []
    by_assets: dict[tuple, list[str]] = {}
    for step in plan:
        by_assets.setdefault(tuple(step["assets"]), []).append(step["batch"])
    for assets, batches in by_assets.items():
        for first, last in consecutive_ranges(order, batches):
            out.append({"first": first, "last": last, "assets": list(assets)})
    return sorted(out, key=lambda r: order.index(r["first"]))


# A run of the batch job that ended without finishing its batch (stopped by a signal, failed, canceled).
UNFINISHED = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
# The run tags Dagster documents for a partition and a partition range (a backfill's single run).
PARTITION_TAG, RANGE_START_TAG, RANGE_END_TAG = (
    "dagster/partition",
    "dagster/asset_partition_range_start",
    "dagster/asset_partition_range_end",
)


def incomplete_batches(instance: DagsterInstance, graph, order: list[str]) -> dict[str, str]:
    """``{batch: reason}`` for each batch of ``order`` (the partitions, in order) that a run left unfinished:
    a per-batch asset never materialised for it (a run stopped or failed after ``video_metadata``), or the
    latest batch run that covered it did not succeed. A rerun of the batch job completes it."""
    assets = sorted(AssetSelection.tag(*PER_BATCH_TAG).resolve(graph))
    done = {key: set(instance.get_materialized_partitions(key)) for key in assets}
    out: dict[str, str] = {}
    for batch in order:
        missing = [k.to_user_string() for k in assets if batch not in done[k]]
        if missing:
            out[batch] = f"{len(missing)} of {len(assets)} per-batch assets missing ({', '.join(missing[:3])}...)"
    position = {b: i for i, b in enumerate(order)}
    seen: set[str] = set()
    for record in instance.get_run_records(RunsFilter(job_name="batch_pipeline")):  # newest first
        run = record.dagster_run
        tags = run.tags
        first = tags.get(PARTITION_TAG) or tags.get(RANGE_START_TAG)
        last = tags.get(PARTITION_TAG) or tags.get(RANGE_END_TAG)
        if first not in position or last not in position:
            continue
        for batch in order[position[first] : position[last] + 1]:
            if batch in seen:
                continue
            seen.add(batch)
            if run.status in UNFINISHED and batch not in out:
                out[batch] = f"its last run ({run.run_id[:8]}) ended {run.status.value}"
    return out
