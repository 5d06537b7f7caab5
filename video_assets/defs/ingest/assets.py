"""Ingest stage assets: the registry of uploaded files and their probed metadata, one partition per batch."""

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import polars as pl
from dagster import AssetExecutionContext, AssetSpec, DataVersion, Failure, MaterializeResult, MetadataValue

from resources.delta import DeltaTables
from resources.volume import RefusedPath, VideoVolume
from video_assets.core.media.probe import ProbeResult, probe
from video_assets.core.media.source import open_media
from video_assets.core.tables import (
    BATCH_MANIFEST,
    KEYS,
    RAW_VIDEOS,
    SCHEMAS,
    STREAM_SEGMENTS,
    VIDEO_METADATA,
    to_arrow,
)
from video_assets.core.uploads.discovery import printable
from video_assets.defs.common import batch_asset, stage_asset, table_metadata

# Written by the live recorder (`video-assets record`), outside any run: each finished segment is a row, reported
# as a materialisation (cli.segment_writer); routing reads it (a segment's camera and time for its alerts).
stream_segments = AssetSpec(
    STREAM_SEGMENTS,
    **stage_asset("ingest", STREAM_SEGMENTS),
    description="Finished segments of live cameras (camera, file, start and end), a row each, written by the recorder.",
)

# Written by the upload sensor and `video-assets register` (never by a run), which report each write
# as a materialisation: an external asset, so the manifest -> raw_videos lineage shows in the UI.
batch_manifest = AssetSpec(
    BATCH_MANIFEST,
    description="Every file ever listed in the volume: its sha256, the batch it went to, or the file it duplicates.",
    **stage_asset("ingest", BATCH_MANIFEST),
)


def batch_version(rows: pl.DataFrame) -> DataVersion:
    """The batch's content: the sorted ids of the videos in it (bytes, not names)."""
    ids = "\n".join(sorted(rows.get_column("video_id").to_list()))
    return DataVersion(hashlib.sha256(ids.encode()).hexdigest()[:16])


def _batch_rows(tables: DeltaTables, name: str, batch: str) -> pl.DataFrame:
    return tables.batch(name, batch, SCHEMAS[name])


@batch_asset("ingest", RAW_VIDEOS, deps=[batch_manifest])
def raw_videos(
    context: AssetExecutionContext, batch: str, volume: VideoVolume, tables: DeltaTables
) -> MaterializeResult:
    """One row per uploaded file, keyed by the sha256 of its bytes; the batch's files come from the
    manifest the upload sensor wrote, so rerunning a batch registers exactly the same files."""
    # The batch's rows only, pushed down to Delta: the manifest lists every file ever seen.
    manifest = tables.read(
        BATCH_MANIFEST, SCHEMAS[BATCH_MANIFEST], where=(pl.col("batch_key") == batch) & (pl.col("status") == "batched")
    )
    if manifest.is_empty():
        raise Failure(
            f"batch {batch!r} has no files in the manifest at {tables.table_uri('batch_manifest')}; "
            "batches are created by the upload sensor or `video-assets register`"
        )
    # Registered rows of this batch's videos only (a video registered by another batch is a duplicate).
    registered = tables.read(
        RAW_VIDEOS, SCHEMAS[RAW_VIDEOS], where=pl.col("video_id").is_in(manifest.get_column("video_id").to_list())
    )
    elsewhere = dict(registered.filter(pl.col("batch_key") != batch).select("video_id", "uri").iter_rows())
    now = datetime.now(UTC)
    rows, missing, changed, duplicates, refused = [], [], [], [], []
    for uri, size, mtime, vid in manifest.select("uri", "size_bytes", "mtime", "video_id").iter_rows():
        shown = printable(uri)
        try:
            current = volume.stat(uri)
            if current is not None and (current.size_bytes != size or abs(current.mtime - mtime.timestamp()) > 1e-3):
                vid = volume.content_hash(uri)  # bytes changed since discovery: register what is there now
                changed.append(uri)
                context.log.warning(f"{shown}: changed since discovery, re-hashed to {vid[:12]}")
        except RefusedPath as exc:  # swapped for a link (or similar) since it was listed
            refused.append({"uri": uri, "reason": str(exc)})
            context.log.warning(f"{shown}: refused: {printable(exc)}; not registered")
            continue
        except FileNotFoundError:
            current = None
        if current is None:
            missing.append(uri)
            context.log.warning(f"{shown}: listed in batch {batch} but no longer in the volume; not registered")
            continue
        if vid in elsewhere:
            duplicates.append(uri)
            context.log.info(f"{shown}: same bytes as {printable(elsewhere[vid])}, already registered")
            continue
        rows.append(
            {
                "video_id": vid,
                "uri": uri,
                "size_bytes": current.size_bytes,
                "mtime": datetime.fromtimestamp(current.mtime, tz=UTC),
                "batch_key": batch,
                "registered_at": now,
            }
        )
    # Two files of one batch with the same bytes were caught at discovery; dedupe again after re-hashes.
    unique = list({r["video_id"]: r for r in rows}.values())
    tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, unique), KEYS[RAW_VIDEOS], keep=("registered_at",))
    out = _batch_rows(tables, RAW_VIDEOS, batch)
    context.log.info(
        f"batch {batch}: {out.height} videos registered, {len(missing)} missing, {len(duplicates)} duplicates, "
        f"{len(refused)} refused"
    )
    return MaterializeResult(
        data_version=batch_version(out),
        metadata={
            **table_metadata(
                tables.table_uri(RAW_VIDEOS),
                out,
                tables.row_count(RAW_VIDEOS),
                ["video_id", "uri", "size_bytes", "batch_key"],
            ),
            "missing_files": MetadataValue.json(missing),
            "refused_files": MetadataValue.json(refused),
            "changed_since_discovery": MetadataValue.json(changed),
            "duplicates_skipped": MetadataValue.json(duplicates),
            "total_bytes": MetadataValue.int(int(out.get_column("size_bytes").sum() or 0)),
        },
    )


def probe_file(uri: str, size_bytes: int) -> ProbeResult:
    """Probe a local path directly, an object-store URI through a seekable stream."""
    if size_bytes == 0:
        return ProbeResult(ok=False, error="empty file (0 bytes)")
    try:
        source = open_media(uri)
    except OSError as exc:  # a link, a vanished object, no permission: a row with the reason
        return ProbeResult(ok=False, error=f"cannot open: {exc.__class__.__name__}: {exc}")
    if isinstance(source, str):
        return probe(source)
    with source as stream:
        return probe(stream)


def _probe_in_volume(volume: VideoVolume, uri: str, size_bytes: int) -> ProbeResult:
    """Checked again before the open: a registered file swapped for a link is a row, never read."""
    reason = volume.refusal(uri)
    if reason is not None:
        return ProbeResult(ok=False, error=f"refused: {reason}")
    return probe_file(uri, size_bytes)


@batch_asset("ingest", VIDEO_METADATA, kinds=("pyav",), deps=[raw_videos])
def video_metadata(
    context: AssetExecutionContext, batch: str, volume: VideoVolume, tables: DeltaTables
) -> MaterializeResult:
    """Container, codec, size, rotation, frame rates, duration, frame and keyframe facts probed with
    PyAV in-process. A file that is not a usable video is a row with ok=false and the reason."""
    videos = _batch_rows(tables, RAW_VIDEOS, batch)
    if videos.is_empty():
        raise Failure(f"raw_videos has no rows for batch {batch!r}: materialise raw_videos for it first")
    items = list(videos.select("video_id", "uri", "size_bytes").iter_rows())
    workers = max(1, min(4, os.cpu_count() or 1, len(items)))  # PyAV releases the GIL while demuxing
    now = datetime.now(UTC)
    rows = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda item: _probe_in_volume(volume, item[1], item[2]), items)
        for i, ((vid, uri, _), result) in enumerate(zip(items, results), start=1):
            name = printable(uri.rsplit("/", 1)[-1])
            if result.ok:
                context.log.info(
                    f"[{i}/{len(items)}] {name}: {result.video_codec} {result.width}x{result.height} "
                    f"{result.duration_s:.1f}s rot={result.rotation}"
                )
            else:
                context.log.warning(f"[{i}/{len(items)}] {name}: not usable: {printable(result.error)}")
            rows.append({"video_id": vid, "batch_key": batch, "uri": uri, **result.as_row(), "probed_at": now})
    tables.merge(VIDEO_METADATA, to_arrow(VIDEO_METADATA, rows), KEYS[VIDEO_METADATA])
    out = _batch_rows(tables, VIDEO_METADATA, batch)
    failed = out.filter(~pl.col("ok"))
    return MaterializeResult(
        data_version=batch_version(out),
        metadata={
            **table_metadata(
                tables.table_uri(VIDEO_METADATA),
                out,
                tables.row_count(VIDEO_METADATA),
                ["uri", "ok", "video_codec", "width", "height", "duration_s", "rotation", "error"],
            ),
            "ok_count": MetadataValue.int(out.height - failed.height),
            "not_ok_count": MetadataValue.int(failed.height),
            "total_duration_s": MetadataValue.float(float(out.get_column("duration_s").sum() or 0.0)),
        },
    )
