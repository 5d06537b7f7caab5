"""A captioning run's Ray job, driven from the step: its rows streamed back and written whole videos at a time
(nothing a job was given goes missing from the table), the sampled frames beside them, and the cost
breakdown the throughput model calibrates on."""

import json
import time
from datetime import UTC, datetime

import polars as pl

from resources.delta import DeltaTables
from video_assets.core.captioning.batch import JobSpec, Transport
from video_assets.core.captioning.job import caption_rows
from video_assets.core.captioning.versions import split_key
from video_assets.core.inference.retries import NO_RESULT
from video_assets.core.inference.service_runner import on_cluster
from video_assets.core.serving import engine_service
from video_assets.core.tables import CAPTIONS, SAMPLED_FRAMES, SCHEMAS, to_arrow
from video_assets.core.throughput import covered_seconds
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

PREVIEW_VIDEOS = 3  # videos whose sampled frames the materialisation shows
WRITE_EVERY = 32  # rows per Delta merge (whole videos): a crash loses at most this much work


def calibration_runs(
    instance, engine: str | None = None, limit: int = 20, runs: int = 2
) -> list[tuple[dict, float, int]]:
    """The latest captions materialisations that captioned something (of ``engine`` when given), of different
    sizes (up to ``runs``): each one's cost breakdown, video seconds and requests (what the throughput
    model calibrates on: `video-assets predict`, and vLLM's decode width)."""
    from dagster import AssetKey

    found: list[tuple[dict, float, int]] = []
    for record in instance.fetch_materializations(AssetKey("captions"), limit=limit, ascending=False).records:
        meta = record.asset_materialization.metadata
        if engine is not None and (meta.get("engine") is None or meta["engine"].value != engine):
            continue
        if "cost_breakdown" in meta and meta.get("requests") and meta["requests"].value > 0:
            requests = int(meta["requests"].value)
            if requests not in {r for _, _, r in found}:
                found.append((meta["cost_breakdown"].value, float(meta["video_s"].value), requests))
            if len(found) == runs:
                break
    return found


def run_captioning(
    log,
    tables: DeltaTables,
    todo: pl.DataFrame,
    spec: JobSpec,
    stamp: dict,
    pending: list[dict] | None = None,
    table: str = CAPTIONS,
) -> dict:
    """Caption ``todo`` (video_metadata rows) with one Ray Data job. Rows are written whole videos at a
    time (merged every WRITE_EVERY rows), each write replacing everything the video had for this model
    and prompt, so a crash between writes never leaves a video half captioned, and stale segments of an
    earlier split go. ``pending`` rows (e.g. probe rejects) are written with the first merge."""
    started = time.perf_counter()
    split = split_key(spec.sampling)
    ready = [{**r, "segments": 1} for r in pending or []]
    arrived: dict[str, dict[int, dict]] = {}  # video -> segment -> row, until every planned segment is in
    whole: set[str] = set()  # videos every planned segment of which came back
    written = cpu_s = engine_s = delta_s = 0.0
    frame_bytes = 0  # the JPEGs the decode stage sent (what crossed the object store)
    screened: list[dict] = []  # frames screened before the engine (media.screening), with their video
    first_row_s = None  # Ray Data start-up, actor spawn, model load and the first batch
    nodes: dict[str, set[str]] = {"decode": set(), "engine": set()}  # Ray node ids each stage ran on
    previews: list[tuple[str, int, bytes]] = []  # (uri, frames, JPEG) of the first videos' segment 0
    videos = todo.select("video_id", "batch_key", "uri", "duration_s", "rotation").to_dicts()
    n_rows = 0
    served_app = None  # the vLLM application the job captioned on, when served (its rows say so)
    # Requests that overlap (vLLM's engine, a server): busy while any is in flight, not their summed latencies.
    overlapping = spec.transport is not Transport.TRANSFORMERS
    in_flight: list[tuple[float, float]] = []  # vLLM: (sent, answered) of each request, as this process saw it
    # The step drives the job; through Ray Client, a task on the cluster does (on_cluster).
    jobs = on_cluster(caption_rows, videos, spec)
    for n_rows, row in enumerate(jobs if videos else [], start=1):
        if first_row_s is None:
            first_row_s = time.perf_counter() - started
        if row["video_id"] in whole:  # a segment Ray computed twice (a retried task), after its video was written
            continue
        name = printable(row["uri"].rsplit("/", 1)[-1])
        if row["status"] == CAPTION_OK:
            log.info(
                f"[{n_rows}] {name} segment {row['segment']}: {row['output_tokens']} tokens in {row['latency_s']:.2f}s"
            )
        else:
            log.warning(f"[{n_rows}] {name}: {printable(row['error'])}")
        cpu_s += row.get("decode_s") or 0.0
        served_app = row.get("served_app") or served_app
        frame_bytes += sum(len(f) for f in row["frames"]) if row.get("frames") is not None else 0
        if overlapping:  # a request's latency, overlapping others: the engine is busy while any is in flight
            done = time.perf_counter()
            in_flight.append((done - float(row.get("engine_s") or 0.0), done))
        else:  # the transformers stage's share of its batch: shares sum to the engines' busy time
            engine_s += row.get("engine_s") or 0.0
        for stage in nodes:
            if row.get(f"{stage}_node"):
                nodes[stage].add(row[f"{stage}_node"])
        if row.get("screened"):
            screened += [{"uri": row["uri"], "segment": int(row["segment"]), **s} for s in json.loads(row["screened"])]
        if row.get("preview") and len(previews) < PREVIEW_VIDEOS:
            previews.append((row["uri"], len(row.get("frame_timestamps") or []), row["preview"]))
        segments = arrived.setdefault(row["video_id"], {})
        segments[int(row["segment"])] = row  # a segment Ray computed twice (a retried task) is kept once
        if len(segments) >= (row.get("segments") or 1):
            ready.extend(arrived.pop(row["video_id"]).values())
            whole.add(row["video_id"])
            if len(ready) >= WRITE_EVERY:
                t0 = time.perf_counter()
                written += _write(tables, ready, stamp, split, table)
                delta_s += time.perf_counter() - t0
                ready = []
    ready.extend(missing_rows(videos, arrived, whole, log))
    if overlapping:
        engine_s = covered_seconds(in_flight)
    t0 = time.perf_counter()
    written += _write(tables, ready, stamp, split, table)
    delta_s += time.perf_counter() - t0
    return {
        "written": written,
        "wall_s": time.perf_counter() - started,
        "first_row_s": first_row_s or 0.0,
        "requests": n_rows,  # segment rows the job produced
        "delta_s": delta_s,
        "cpu_s": cpu_s,
        "engine_s": engine_s,
        "nodes": {k: sorted(v) for k, v in nodes.items()},
        "previews": previews,
        "frame_bytes": frame_bytes,
        "screened": screened,
        "service": engine_service(spec, served_app),
    }


def missing_rows(videos: list[dict], arrived: dict[str, dict[int, dict]], done: set[str], log) -> list[dict]:
    """What a finished job left without a result, as rows: the segments that came back for videos that are
    not whole (``arrived``), an error row for each planned segment that did not, and one error row for a
    video that sent nothing at all (every batch holding it dropped, ``core.inference.retries``). ``done``:
    videos already whole. Nothing a job was given goes missing from the table."""
    rows: list[dict] = []
    for segments in arrived.values():
        planned = max(int(r.get("segments") or 1) for r in segments.values())
        some = next(iter(segments.values()))
        missing = [i for i in range(planned) if i not in segments]
        log.warning(f"{printable(some['uri'])}: no result for segments {missing}; written as error rows")
        rows.extend(segments.values())
        rows.extend(
            {**{k: some.get(k) for k in ("video_id", "batch_key", "uri", "segments")}, "segment": i}
            | {"frame_timestamps": [], "prose": "", "status": CAPTION_ERROR, "error": NO_RESULT}
            for i in missing
        )
    for video in videos:
        if video["video_id"] not in done and video["video_id"] not in arrived:
            log.warning(f"{printable(video['uri'])}: no result at all; written as an error row")
            rows.append(
                {k: video[k] for k in ("video_id", "batch_key", "uri")}
                | {"segment": 0, "segments": 1, "frame_timestamps": [], "prose": "", "status": CAPTION_ERROR}
                | {"error": NO_RESULT}
            )
    return rows


def _write(tables: DeltaTables, rows: list[dict], stamp: dict, split: str, table: str) -> int:
    """Write whole videos: in one commit, their rows for this model and prompt are replaced by ``rows``
    (a rerun's rows, or another split's, leave nothing stale behind)."""
    if not rows:
        return 0
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[table]]
    full = [{**{c: r.get(c) for c in cols}, **stamp, "split": split, "captioned_at": now} for r in rows]
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),  # lets Delta skip other batches' files
        "video_id": sorted({r["video_id"] for r in full}),
        "model_version": [str(stamp["model_version"])],
        "prompt_version": [int(stamp["prompt_version"])],
    }
    if table == CAPTIONS:  # first: a crash between the two commits leaves frames without captions, not the reverse
        tables.replace_where(SAMPLED_FRAMES, to_arrow(SAMPLED_FRAMES, sampled_frame_rows(rows, stamp, now)), selection)
    tables.replace_where(table, to_arrow(table, full), selection)
    return len(full)


def sampled_frame_rows(rows: list[dict], stamp: dict, now: datetime) -> list[dict]:
    """The JPEGs each ok caption row was made from (the decode stage's, ``core.media.frames``), a row each."""
    out = []
    for r in rows:
        images = r.get("frames")
        if r.get("status") != CAPTION_OK or images is None or len(images) != len(r.get("frame_timestamps") or []):
            continue
        screened = {s["frame"]: s for s in json.loads(r.get("screened") or "[]") if s.get("to_s") is not None}
        for j, (t, image) in enumerate(zip(r["frame_timestamps"], images)):
            why = screened.get(j, {})
            out.append(
                {k: r[k] for k in ("video_id", "batch_key", "uri")}
                | {"segment": int(r["segment"]), "frame": j, "timestamp_s": float(t), "image": bytes(image)}
                | {"screened": why.get("reason"), "screened_from_s": why.get("from_s")}
                | {"model_version": str(stamp["model_version"]), "prompt_version": int(stamp["prompt_version"])}
                | {"sampled_at": now}
            )
    return out
