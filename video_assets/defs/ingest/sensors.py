"""The upload sensor: new files in the volume become a new batch partition and a run for it."""

import base64
import json
import os
import time
import zlib
from dataclasses import dataclass

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
from video_assets.core.media.source import is_remote
from video_assets.core.uploads import discovery as registry
from video_assets.defs.common import escaped_log
from video_assets.defs.ingest.jobs import batch_pipeline_job
from video_assets.defs.ingest.registration import (
    manifest_batch_keys,
    manifest_of,
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


@dataclass
class TickState:
    """What a tick leaves for the next (its cursor): the digest of the last whole listing (None: unfinished),
    the batches it requested (None: unknown), and for a local volume every folder's mtime and subfolders as it
    last listed them (``VideoVolume.changed_listing``) with when it last listed everything."""

    digest: str | None = None
    batches: list[str] | None = None
    folders: dict[str, list] | None = None
    full_at: float = 0.0


def encode_cursor(state: TickState, root: str = "") -> str:
    """The cursor as JSON; the folder map relative to ``root`` and compressed (a few bytes a folder: a cursor is
    stored with every tick)."""
    out = {"digest": state.digest, "batches": sorted(state.batches or []), "full_at": state.full_at}
    if state.folders is not None:
        rel = {_rel(k, root): [v[0], [_rel(c, root) for c in v[1]]] for k, v in state.folders.items()}
        out["folders"] = base64.b64encode(zlib.compress(json.dumps(rel, separators=(",", ":")).encode())).decode()
    return json.dumps(out)


def decode_cursor(cursor: str | None, root: str = "") -> TickState:
    """The state ``encode_cursor`` wrote; an empty one for no cursor or one this code cannot read (then the
    tick lists everything, which is always right)."""
    try:
        data = json.loads(cursor or "")
        state = TickState(data["digest"], list(data["batches"]), None, float(data.get("full_at") or 0.0))
    except (ValueError, TypeError, KeyError):
        return TickState()
    try:
        if data.get("folders"):
            rel = json.loads(zlib.decompress(base64.b64decode(data["folders"])))
            state.folders = {_abs(k, root): [int(v[0]), [_abs(c, root) for c in v[1]]] for k, v in rel.items()}
    except (ValueError, TypeError, KeyError, IndexError, zlib.error):
        state.folders = None
    return state


def _rel(path: str, root: str) -> str:
    return os.path.relpath(path, root) if root and os.path.isabs(path) else path


def _abs(path: str, root: str) -> str:
    return os.path.normpath(os.path.join(root, path)) if root else path


@sensor(
    job=batch_pipeline_job,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Lists the video volume; unseen files are hashed, grouped into batches of at most "
    "batch_size, added as video_batches partitions and run. A local volume's tick lists only the folders "
    "that changed since the last (cursor: their mtimes; everything every full_listing_s) and reads only "
    "those files' manifest rows; an unchanged volume reads no table.",
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


def _skip(context: SensorEvaluationContext, message: str, cursor: str):
    """A skipped tick, storing ``cursor`` only when it differs from the one the tick started from (a whole
    listing's time and folders)."""
    if cursor == context.cursor:
        return SkipReason(message)
    return SensorResult(skip_reason=SkipReason(message), cursor=cursor)


def _tick(context: SensorEvaluationContext, volume: VideoVolume, tables: DeltaTables, streams: bool):
    """One tick over the uploads (``streams`` False: everything but streams/) or the camera segments."""
    escaped_log(context)  # the tick logs file names and reasons: one line each, whatever they hold
    local = not is_remote(volume.uri)
    root = volume.local_root() if local else ""
    last = decode_cursor(context.cursor, root)
    now = time.time()
    # A local volume: only the folders that changed since the last tick are listed (their mtimes moved), and
    # everything every full_listing_s (a file rewritten in place moves no folder). A bucket is listed whole.
    full = not local or last.folders is None or now - last.full_at >= volume.full_listing_s
    state = TickState(last.digest, None, last.folders, now if full and local else last.full_at)
    if local:
        walk = volume.changed_listing(None if full else last.folders, streams)
        listing, state.folders, unchanged = walk.listing, walk.folders, not full and not walk.changed
        files = listing.files
    else:
        listing = volume.listing()
        files = [f for f in listing.files if volume.is_stream(f.uri) == streams]
        if streams:
            listing = type(listing)(files, [])  # refused entries are the upload sensor's to report
        unchanged = False
    if full:
        # Refused entries are part of the digest, so a new link is reported on the next tick.
        state.digest = registry.listing_digest(files, listing.refused)
        unchanged = state.digest == last.digest
    if unchanged and last.batches is not None:
        # Unchanged volume: no table is read, so an idle tick costs a walk of the folders (a listing, for a
        # bucket) however large the archive. A tick that died after writing the manifest never stored its
        # cursor, so its folders look changed to the next one, which reads their manifest rows and repairs; a
        # cursor is stored only after its batches became partitions, so one that is missing now (deleted) is
        # the only repair left to look for here, and the instance answers that.
        if all(context.instance.has_dynamic_partition(video_batches.name, k) for k in last.batches):
            state.batches = last.batches
            return _skip(context, f"no change in {volume.uri}", encode_cursor(state, root))
    known_partitions = set(context.instance.get_dynamic_partitions(video_batches.name))
    # Batches written to the manifest by a tick that died before adding them: repair first (the upload
    # sensor repairs every batch; sensors tick one after the other, so none is in flight then). A tick that
    # listed a few folders reads only their files' rows: a dead tick's batches are among them.
    partial = local and not full
    manifest = manifest_of(tables, [f.uri for f in files]) if partial else read_manifest(tables)
    orphaned = [] if streams else [k for k in manifest_batch_keys(manifest) if k not in known_partitions]
    orphaned += [k for k in last.batches or [] if k not in known_partitions and k not in orphaned]
    if unchanged and not orphaned:
        state.batches = last.batches
        return _skip(context, f"no change in {volume.uri}", encode_cursor(state, root))

    plan = register_new_files(volume, tables, files, manifest=manifest, partial=partial)
    refused = listing.refused + plan.unreadable
    for r in refused:
        context.log.warning(f"{registry.printable(r.uri)}: refused: {r.reason}")
    for dup in plan.duplicates:
        context.log.info(
            f"{registry.printable(dup.uri)}: same bytes as {registry.printable(dup.duplicate_of)}; not registered again"
        )
    new_keys = sorted(set(plan.batches) | set(orphaned))
    state.batches = new_keys
    if plan.remaining:  # an unfinished listing: the next tick lists these folders again and carries on
        state.digest, state.folders, state.full_at = None, last.folders if partial else None, last.full_at
    next_cursor = encode_cursor(state, root)
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
