"""The upload sensor: new files in the volume become a new batch partition and a run for it."""

import json

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from resources.delta import DeltaTables
from resources.volume import VideoVolume
from video_assets.core.uploads import discovery as registry
from video_assets.defs.common import escaped_log
from video_assets.defs.ingest.jobs import batch_pipeline_job
from video_assets.defs.ingest.registration import (
    manifest_batch_keys,
    read_manifest,
    refused_event,
    register_new_files,
)
from video_assets.defs.partitions import video_batches

SENSOR_INTERVAL_S = 30
# Camera segments (streams/ in the volume, written by `video-assets record`) are registered by their own
# sensor every few seconds, and their runs go ahead of archive backfills in the run queue.
STREAM_SENSOR_INTERVAL_S = 5
STREAM_RUN_PRIORITY = "10"  # QueuedRunCoordinator: higher first; a run without the tag is 0


def encode_cursor(digest: str | None, batches: list[str]) -> str:
    """The cursor: the digest of the listing the tick finished (None: unfinished) and the batches it
    requested, so the next tick can tell an unchanged volume from one needing work or repair."""
    return json.dumps({"digest": digest, "batches": sorted(batches)})


def decode_cursor(cursor: str | None) -> tuple[str | None, list[str] | None]:
    """(digest, batches); batches None when unknown (no cursor, or one from before batches were kept)."""
    try:
        state = json.loads(cursor or "")
        return state["digest"], list(state["batches"])
    except (ValueError, TypeError, KeyError):
        return None, None


@sensor(
    job=batch_pipeline_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Lists the video volume; unseen files are hashed, grouped into batches of at most "
    "batch_size, added as video_batches partitions and run. Cursor: a digest of the last listing and the "
    "batches it requested; an unchanged listing reads no table.",
)
def upload_sensor(context: SensorEvaluationContext, volume: VideoVolume, tables: DeltaTables):
    return _tick(context, volume, tables, streams=False)


@sensor(
    job=batch_pipeline_job,
    minimum_interval_seconds=STREAM_SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers the cameras' finished segments (streams/ in the volume) every few seconds as "
    "micro-batches whose runs go ahead of archive batches in the queue (dagster/priority).",
)
def stream_sensor(context: SensorEvaluationContext, volume: VideoVolume, tables: DeltaTables):
    return _tick(context, volume, tables, streams=True)


def _tick(context: SensorEvaluationContext, volume: VideoVolume, tables: DeltaTables, streams: bool):
    """One tick over the uploads (``streams`` False: everything but streams/) or the camera segments."""
    escaped_log(context)  # the tick logs file names and reasons: one line each, whatever they hold
    listing = volume.listing()
    files = [f for f in listing.files if volume.is_stream(f.uri) == streams]
    if streams:
        listing = type(listing)(files, [])  # refused entries are the upload sensor's to report
    # Refused entries are part of the digest, so a new link is reported on the next tick.
    digest = registry.listing_digest(files, listing.refused)
    last_digest, last_batches = decode_cursor(context.cursor)
    if last_digest == digest and last_batches is not None:
        # Unchanged volume: no table is read, so an idle tick costs one listing however large the
        # archive. A tick that died after writing the manifest never stored its cursor, so the listing
        # looks changed to the next one, which reads the manifest and repairs; a cursor is stored only
        # after its batches became partitions, so one that is missing now (deleted) is the only repair
        # left to look for here, and the instance answers that.
        if all(context.instance.has_dynamic_partition(video_batches.name, k) for k in last_batches):
            return SkipReason(f"no change in {volume.uri} ({len(files)} files)")
    known_partitions = set(context.instance.get_dynamic_partitions(video_batches.name))
    # Batches written to the manifest by a tick that died before adding them: repair first (the upload
    # sensor repairs every batch; sensors tick one after the other, so none is in flight then).
    manifest = read_manifest(tables)
    orphaned = [] if streams else [k for k in manifest_batch_keys(manifest) if k not in known_partitions]
    if last_digest == digest and not orphaned:
        return SkipReason(f"no change in {volume.uri} ({len(files)} files)")

    plan = register_new_files(volume, tables, files, manifest=manifest)
    refused = listing.refused + plan.unreadable
    for r in refused:
        context.log.warning(f"{registry.printable(r.uri)}: refused: {r.reason}")
    for dup in plan.duplicates:
        context.log.info(
            f"{registry.printable(dup.uri)}: same bytes as {registry.printable(dup.duplicate_of)}; not registered again"
        )
    new_keys = sorted(set(plan.batches) | set(orphaned))
    # An unfinished listing stores no digest, so the next tick lists again and carries on.
    next_cursor = encode_cursor(digest if plan.remaining == 0 else None, new_keys)
    # What this tick wrote to batch_manifest is reported as its materialisation (lineage in the UI).
    events = [e for e in [plan.manifest_event(tables), refused_event(refused)] if e is not None]
    if not new_keys:
        return SensorResult(
            skip_reason=SkipReason("no new videos (only duplicates or known files)"),
            cursor=next_cursor,
            asset_events=events,
        )
    context.log.info(
        f"{sum(len(v) for v in plan.batches.values())} new files in {len(new_keys)} batches; "
        f"{len(plan.duplicates)} duplicates; {plan.remaining} left for the next tick"
    )
    tags = {"dagster/priority": STREAM_RUN_PRIORITY, "video/source": "stream"} if streams else {}
    return SensorResult(
        run_requests=[RunRequest(run_key=k, partition_key=k, tags={"video/batch": k, **tags}) for k in new_keys],
        dynamic_partitions_requests=[video_batches.build_add_request(new_keys)],
        cursor=next_cursor,
        asset_events=events,
    )
