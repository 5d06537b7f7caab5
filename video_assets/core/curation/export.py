"""The training-sample export: the kept frames of the frames table, with their descriptions and image
bytes, as Parquet shards plus a manifest, read from one Delta table version so that an export can be
made again, byte for byte, from the version its manifest names.

    <out>/part-00000.parquet ...   rows sorted by (video_id, segment, frame, curation_version)
    <out>/manifest.json            table uri and version read, filters, row counts, shard sha256s
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

EXPORT_COLUMNS = (
    "video_id",
    "uri",
    "segment",
    "frame",
    "curation_version",
    "timestamp_s",
    "description",
    "phash",
    "crop_x0",
    "crop_y0",
    "crop_x1",
    "crop_y1",
    "image",
)
SORT_KEY = [("video_id", "ascending"), ("segment", "ascending"), ("frame", "ascending")]
MANIFEST = "manifest.json"


def _image_bytes(table: pa.Table) -> list[bytes | None]:
    """Each row's JPEG: the ``image`` column, else the file ``image_uri`` names."""
    blobs = table.column("image").to_pylist()
    paths = table.column("image_uri").to_pylist() if "image_uri" in table.column_names else [None] * len(blobs)
    return [b if b is not None else (Path(p).read_bytes() if p else None) for b, p in zip(blobs, paths)]


def export_frames(
    table_uri: str,
    out_dir: str | Path,
    version: int | None = None,
    curation_version: str | None = None,
    shard_rows: int = 1000,
    storage_options: dict | None = None,
) -> dict:
    """Write the kept frames of the Delta table at ``table_uri`` (``version``: that table version, None:
    the latest) into ``out_dir``; returns the manifest (also written as manifest.json)."""
    from deltalake import DeltaTable

    if shard_rows < 1:
        raise ValueError("shard_rows must be >= 1")
    dt = DeltaTable(table_uri, version=version, storage_options=storage_options)
    table = dt.to_pyarrow_table()
    mask = pc.equal(table.column("kept"), True)
    if curation_version:
        mask = pc.and_(mask, pc.equal(table.column("curation_version"), curation_version))
    kept = table.filter(mask)
    kept = kept.sort_by([*SORT_KEY, ("curation_version", "ascending")])
    images = _image_bytes(kept)
    missing = sum(1 for b in images if b is None)
    if missing:
        raise ValueError(f"{missing} kept frames have neither image bytes nor an image file")
    kept = kept.set_column(kept.column_names.index("image"), "image", pa.array(images, pa.binary()))
    kept = kept.select(list(EXPORT_COLUMNS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.parquet"):  # a rerun into the same folder leaves no stale shard
        old.unlink()
    shards = []
    for i, start in enumerate(range(0, kept.num_rows, shard_rows)):
        name = f"part-{i:05d}.parquet"
        pq.write_table(kept.slice(start, shard_rows), out / name, compression="zstd")
        data = (out / name).read_bytes()
        shards.append({"file": name, "rows": min(shard_rows, kept.num_rows - start), "sha256": _sha(data)})
    manifest = {
        "table_uri": table_uri,
        "table_version": dt.version(),
        "curation_version": curation_version,
        "rows_in_table": table.num_rows,
        "rows": kept.num_rows,
        "videos": len(set(kept.column("video_id").to_pylist())),
        "columns": list(EXPORT_COLUMNS),
        "sort": [k for k, _ in SORT_KEY] + ["curation_version"],
        "shards": shards,
    }
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(out / MANIFEST)
    return manifest


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_export(out_dir: str | Path) -> tuple[dict, pa.Table]:
    """The manifest and the shards of an export as one table; a shard whose checksum differs from the
    manifest's is an error."""
    out = Path(out_dir)
    manifest = json.loads((out / MANIFEST).read_text())
    parts = []
    for shard in manifest["shards"]:
        data = (out / shard["file"]).read_bytes()
        if _sha(data) != shard["sha256"]:
            raise ValueError(f"{shard['file']}: checksum differs from the manifest")
        parts.append(pq.read_table(out / shard["file"]))
    return manifest, (pa.concat_tables(parts) if parts else pa.table({}))
