"""Registering uploads: list the volume, hash what is new, record batches in the manifest
(``batch_manifest``, written before any partition exists).

Shared by the upload sensor and the `video-assets register` command, so both make the same batches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import UTC, datetime

import polars as pl
from dagster import AssetMaterialization, AssetObservation, MetadataValue

from resources.delta import DeltaTables
from resources.volume import VideoVolume
from video_assets.core.tables import BATCH_MANIFEST, KEYS, SCHEMAS, to_arrow
from video_assets.core.uploads import discovery as registry
from video_assets.core.uploads.discovery import Refused, VolumeFile, printable


@dataclass
class RegistrationPlan:
    batches: dict[str, list[registry.Discovery]] = field(default_factory=dict)
    duplicates: list[registry.Discovery] = field(default_factory=list)
    remaining: int = 0  # new files left for the next call (per-call hashing bound)
    rows_written: int = 0  # manifest rows appended (batched + duplicate files)
    unreadable: list[Refused] = field(default_factory=list)  # listed but not hashable; retried next call

    def manifest_event(self, tables: DeltaTables) -> AssetMaterialization | None:
        """The batch_manifest materialisation to report for what this call wrote (None if nothing)."""
        if not self.rows_written:
            return None
        return AssetMaterialization(
            asset_key=BATCH_MANIFEST,
            metadata={
                "dagster/uri": MetadataValue.path(tables.table_uri(BATCH_MANIFEST)),
                "rows_written": MetadataValue.int(self.rows_written),
                "batches": MetadataValue.json(sorted(self.batches)),
                "duplicates": MetadataValue.int(len(self.duplicates)),
            },
        )


def refused_event(refused: list[Refused]) -> AssetObservation | None:
    """Entries of the volume that were not read (links, special files), each with the reason, as an
    observation of batch_manifest: visible in the asset's events, never silently missing."""
    if not refused:
        return None
    return AssetObservation(
        asset_key=BATCH_MANIFEST,
        metadata={
            "refused_count": MetadataValue.int(len(refused)),
            "refused": MetadataValue.json([{"uri": printable(r.uri), "reason": r.reason} for r in refused]),
        },
    )


def read_manifest(tables: DeltaTables) -> pl.DataFrame:
    return tables.read(BATCH_MANIFEST, SCHEMAS[BATCH_MANIFEST])


def manifest_of(tables: DeltaTables, uris: list[str]) -> pl.DataFrame:
    """The manifest rows of ``uris`` only (pushed down to Delta): what a tick that listed a few changed folders
    needs to know which of their files are new, however large the archive."""
    return tables.read(BATCH_MANIFEST, SCHEMAS[BATCH_MANIFEST], where=pl.col("uri").is_in(uris))


def batched_ids(tables: DeltaTables, video_ids: list[str]) -> dict[str, str]:
    """video_id -> the uri first registered with those bytes, for ``video_ids`` only (pushed down to Delta)."""
    if not video_ids:
        return {}
    rows = tables.read(
        BATCH_MANIFEST,
        SCHEMAS[BATCH_MANIFEST],
        where=pl.col("video_id").is_in(video_ids) & (pl.col("status") == "batched"),
    ).sort("discovered_at", "uri")
    return dict(reversed(rows.select("video_id", "uri").rows()))  # the first registration wins


def manifest_batch_keys(manifest: pl.DataFrame) -> list[str]:
    return sorted(manifest.get_column("batch_key").drop_nulls().unique().to_list())


def _seen(manifest: pl.DataFrame) -> tuple[set, dict[str, str]]:
    seen = set()
    known: dict[str, str] = {}
    for uri, size, mtime, vid, status in manifest.select(
        "uri", "size_bytes", "mtime", "video_id", "status"
    ).iter_rows():
        seen.add(registry.fingerprint(VolumeFile(uri, size, mtime.timestamp())))
        if status == "batched":
            known.setdefault(vid, uri)
    return seen, known


def register_new_files(
    volume: VideoVolume,
    tables: DeltaTables,
    files: list[VolumeFile] | None = None,
    now: datetime | None = None,
    manifest: pl.DataFrame | None = None,
    partial: bool = False,
) -> RegistrationPlan:
    """Hash unseen files (at most ``volume.max_files_per_call``), batch them, append to the manifest.

    The manifest is written before any partition is added, so a crash in between is repaired by
    the next call (batches in the manifest that are not partitions yet get added then).
    ``manifest``: the manifest as just read by the caller, to save a second read; ``partial``: it holds only the
    rows of ``files`` (``manifest_of``), so the bytes already registered elsewhere are looked up for the new
    files' ids alone (``batched_ids``).
    """
    now = now or datetime.now(UTC)
    files = volume.list_files() if files is None else files
    seen, known = _seen(read_manifest(tables) if manifest is None else manifest)
    if partial:
        known = functools.partial(batched_ids, tables)
    unreadable: list[Refused] = []
    found, remaining = registry.discover(
        files, seen, known, volume.content_hash, volume.max_files_per_call, unreadable=unreadable
    )
    batches = registry.plan_batches(found, now, volume.batch_size)
    rows = registry.manifest_rows(found, batches, now)
    if rows:
        manifest_rows = to_arrow(BATCH_MANIFEST, rows)
        tables.merge(BATCH_MANIFEST, manifest_rows, KEYS[BATCH_MANIFEST], update=False, scope="uri")
    return RegistrationPlan(
        batches=batches,
        duplicates=[d for d in found if d.duplicate_of],
        remaining=remaining,
        rows_written=len(rows),
        unreadable=unreadable,
    )
