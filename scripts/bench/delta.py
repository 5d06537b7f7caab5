"""Benchmark section: a new batch's Delta work with 1 batch vs 1,000 batches already in the tables.

A batch's Delta work (what the per-batch assets do to the captions table: read the batch's rows, merge
its new rows whole videos at a time, count the table) is timed on a table holding 1 batch and on one
holding ``BATCHES`` synthetic batches, and compared with the way it was done before (whole-table read
then filter, merge on the key alone). Target: the archive-independent way within 20 % (1.2x).

    .venv/bin/python -m scripts.bench.delta
"""

from __future__ import annotations

import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from deltalake import DeltaTable, write_deltalake

BATCHES = 1000
VIDEOS_PER_BATCH = 5
SEGMENTS = 2
REPEATS = 5


def _rows(batch: str, stamp: str = "x") -> list[dict]:
    now = datetime.now(UTC)
    return [
        {
            "video_id": f"{batch}-v{v}",
            "batch_key": batch,
            "uri": f"/volume/{batch}/v{v}.mp4",
            "segment": s,
            "frame_timestamps": [0.0, 1.0, 2.0],
            "prose": f"{stamp} a person picks up a cup and puts it down. " * 4,
            "model_name": "m",
            "model_version": "1",
            "prompt_version": 1,
            "engine": "transformers",
            "status": "ok",
            "segments": SEGMENTS,
            "split": "segment_s=none;scene_split=false",
            "captioned_at": now,
        }
        for v in range(VIDEOS_PER_BATCH)
        for s in range(SEGMENTS)
    ]


def _build(root: Path, batches: int) -> object:
    from resources.delta import DeltaTables
    from video_assets.core.tables import CAPTIONS, to_arrow

    shutil.rmtree(root, ignore_errors=True)
    tables = DeltaTables(root_uri=str(root))
    uri = tables.table_uri(CAPTIONS)
    per_commit = 10  # batches per file, in key order: like merges, each file holds a few batches
    for start in range(0, batches, per_commit):
        rows = [r for b in range(start, min(batches, start + per_commit)) for r in _rows(f"b{b:05d}")]
        write_deltalake(uri, to_arrow(CAPTIONS, rows), mode="append")
    # A long-lived table has checkpoints (delta-rs writes one every 100 commits; maintain_tables too):
    # readers start from the checkpoint instead of replaying every commit.
    DeltaTable(uri).create_checkpoint()
    return tables


def _time(fn) -> float:
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _batch_work(tables, batch: str, old: bool) -> float:
    from video_assets.core.tables import CAPTIONS, KEYS, SCHEMAS, to_arrow

    uri = tables.table_uri(CAPTIONS)
    rows = to_arrow(CAPTIONS, _rows(batch, stamp=str(time.perf_counter())))
    selection = {
        "batch_key": [batch],
        "video_id": sorted(set(rows.column("video_id").to_pylist())),
        "model_version": ["1"],
        "prompt_version": [1],
    }

    def new_way():  # what the captions asset does now (runner._write)
        tables.batch(CAPTIONS, batch, SCHEMAS[CAPTIONS])
        tables.replace_where(CAPTIONS, rows, selection)
        tables.batch(CAPTIONS, batch, SCHEMAS[CAPTIONS])
        tables.row_count(CAPTIONS)

    def old_way():
        pl.read_delta(uri).filter(pl.col("batch_key") == batch)
        predicate = " AND ".join(f"t.{k} = s.{k}" for k in KEYS[CAPTIONS])
        DeltaTable(uri).merge(
            rows, predicate, source_alias="s", target_alias="t"
        ).when_matched_update_all().when_not_matched_insert_all().execute()
        pl.read_delta(uri).filter(pl.col("batch_key") == batch)
        return pl.read_delta(uri).height

    return _time(old_way if old else new_way)


def rows(clips: list[Path] | None = None, work: Path | None = None) -> list[dict]:
    work = Path(work or "/tmp/video-assets-bench") / "delta"
    small = _build(work / "one", 1)
    large = _build(work / "many", BATCHES)
    out = []
    for old in (False, True):
        # interleaved: the same new batch on the small and the large table, alternately
        t_small = _batch_work(small, "b-new", old)
        t_large = _batch_work(large, "b-new", old)
        t_small = min(t_small, _batch_work(small, "b-new", old))
        t_large = min(t_large, _batch_work(large, "b-new", old))
        out.append(
            {
                "measurement": f"a new batch's Delta work, {BATCHES} batches vs 1 ({'before' if old else 'now'})",
                "ours_s": t_large,
                "baseline": "same work with 1 batch in the table",
                "baseline_s": t_small,
                "ratio": t_large / t_small if t_small else float("nan"),
                "target": "<= 1.2x" if not old else "(for comparison)",
                "note": "read batch + write whole videos + read batch + row count"
                + (
                    "; whole-table reads, key-only merge"
                    if old
                    else "; pushed-down reads, one predicate overwrite, log count"
                ),
            }
        )
    shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    for r in rows():
        print(
            f"{r['measurement']}: {r['ours_s'] * 1000:.0f} ms vs {r['baseline_s'] * 1000:.0f} ms = {r['ratio']:.2f}x (target {r['target']})"
        )
