"""Benchmark section: a sensor tick after one new file, with a large archive in the volume vs a small one.

The real upload sensor (and stream sensor) on a real Dagster instance and real Delta tables, over a local
volume of small files (uploads in folders of 100; camera segments in their camera's folder, as the recorder writes them),
every file already in ``batch_manifest``. Each tick follows one new file (in a new folder, then in an existing
one) and starts from the previous tick's cursor, as the daemon's do; the median tick of each archive size, the
two sizes interleaved. Target (issue 41): <= 2x with 100x the files.

    .venv/bin/python -m scripts.bench.ticks
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

UPLOADS = (200, 20_000)
SEGMENTS = (20, 2_000)
PER_FOLDER = 100
TICKS = 5


def _archive(root: Path, files: int, streams: bool):
    """A volume of ``files`` small files already registered (the manifest written as the sensor writes it,
    a few hundred rows a commit), the Delta tables and the partitions they name."""
    from deltalake import DeltaTable

    from resources.delta import DeltaTables
    from resources.volume import VideoVolume
    from video_assets.core.tables import BATCH_MANIFEST, KEYS, to_arrow

    shutil.rmtree(root, ignore_errors=True)
    volume_dir = root / "volume"
    base = volume_dir / "streams" / "cam0" if streams else volume_dir
    for i in range(files):
        folder = base if streams else base / f"h{i // PER_FOLDER:05d}"  # the recorder's layout: one folder a camera
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i:06d}.mp4").write_bytes(b"v" * 64 + str(i).encode())
    volume = VideoVolume(uri=str(volume_dir), batch_size=50)
    tables = DeltaTables(root_uri=str(root / "tables"))
    now = datetime.now(UTC)
    rows = [
        {
            "uri": f.uri,
            "size_bytes": f.size_bytes,
            "mtime": datetime.fromtimestamp(f.mtime, tz=UTC),
            "video_id": f"{i:064x}",
            "status": "batched",
            "batch_key": f"b{i // 50:06d}",
            "duplicate_of": None,
            "discovered_at": now,
        }
        for i, f in enumerate(volume.listing().files)
    ]
    for start in range(0, len(rows), 500):
        tables.merge(BATCH_MANIFEST, to_arrow(BATCH_MANIFEST, rows[start : start + 500]), KEYS[BATCH_MANIFEST])
    # A long-lived table has a checkpoint (delta-rs writes one every 100 commits): the log replayed at each
    # open is then bounded, whatever the commits that built it; both archives get one.
    DeltaTable(tables.table_uri(BATCH_MANIFEST)).create_checkpoint()
    return volume, tables, sorted({r["batch_key"] for r in rows}), base


class _Archive:
    def __init__(self, root: Path, files: int, streams: bool):
        from dagster import DagsterInstance

        self.volume, self.tables, keys, self.base = _archive(root, files, streams)
        self.instance = DagsterInstance.ephemeral()
        self.instance.add_dynamic_partitions("video_batches", keys)
        self.streams = streams
        self.cursor = None
        self.new = 0
        self.tick()  # the first tick (no cursor) lists everything: not what is timed

    def tick(self) -> float:
        from dagster import SensorResult, build_sensor_context

        from video_assets.defs.ingest.sensors import stream_sensor, upload_sensor

        sensor = stream_sensor if self.streams else upload_sensor
        ctx = build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"volume": self.volume, "tables": self.tables}
        )
        started = time.perf_counter()
        result = sensor(ctx)
        took = time.perf_counter() - started
        if isinstance(result, SensorResult):
            self.cursor = result.cursor or self.cursor
            for req in result.dynamic_partitions_requests or []:
                self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        return took

    def one_new_file(self) -> float:
        # uploads: a new folder, then an existing one; segments: the camera's folder, as the recorder writes them
        folder = self.base if self.streams else self.base / ("new" if self.new % 2 == 0 else "h00000")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"new{self.new:04d}.mp4").write_bytes(os.urandom(256))
        self.new += 1
        return self.tick()


def rows(clips: list[Path] | None = None, work: Path | None = None) -> list[dict]:
    work = Path(work or "/tmp/video-assets-bench") / "ticks"
    out = []
    for streams, (small_n, large_n) in ((False, UPLOADS), (True, SEGMENTS)):
        small = _Archive(work / f"small-{streams}", small_n, streams)
        large = _Archive(work / f"large-{streams}", large_n, streams)
        t_small, t_large, idle_small, idle_large = [], [], [], []
        for _ in range(TICKS):  # interleaved
            t_small.append(small.one_new_file())
            t_large.append(large.one_new_file())
            idle_small.append(small.tick())
            idle_large.append(large.tick())
        what = "stream sensor, segments" if streams else "upload sensor, files"
        for label, a, b in (("after one new file", t_large, t_small), ("idle (nothing new)", idle_large, idle_small)):
            ours, base = statistics.median(a), statistics.median(b)
            out.append(
                {
                    "measurement": f"{what}: a tick {label}, {large_n:,} vs {small_n:,} in the volume",
                    "ours_s": ours,
                    "baseline": f"the same tick with {small_n:,}",
                    "baseline_s": base,
                    "ratio": ours / base if base else float("nan"),
                    "target": "<= 2x" if label.startswith("after") else "(idle)",
                    "note": f"median of {TICKS}; folders of {PER_FOLDER}; real sensor, instance and Delta tables",
                }
            )
    shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    for r in rows():
        print(f"{r['measurement']}: {r['ours_s'] * 1000:.0f} ms vs {r['baseline_s'] * 1000:.0f} ms = {r['ratio']:.2f}x")
