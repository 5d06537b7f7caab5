"""Transcripts stage asset: what is said in each video, with word times, from the speech model behind
the alias; per batch and idempotent (a video already transcribed by that version is not redone)."""

import json
import time
from datetime import UTC, datetime

import polars as pl
from dagster import AssetExecutionContext, Config, DataVersion, Failure, MaterializeResult, MetadataValue
from dagster_ray import RayResource
from pydantic import Field

from resources.archive import SPEECH, ArchiveSettings
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from video_assets.core.tables import SCHEMAS, TRANSCRIPTS, VIDEO_METADATA, to_arrow
from video_assets.core.transcription.job import transcript_job_rows
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import TRANSCRIPT_ERROR, TRANSCRIPT_SPEECH
from video_assets.defs.common import ACCELERATOR_POOL, batch_asset, table_metadata
from video_assets.defs.ray_session import cluster_gpus
from video_assets.defs.registry import archive_model_files

WRITE_EVERY = 8  # videos per Delta write: a crash loses at most this much work
EXCERPT_VIDEOS = 3


class TranscriptsConfig(Config):
    retranscribe: bool = Field(default=False, description="Transcribe again what this model version already did")


def whisper_settings(archive: ArchiveSettings, device: str) -> dict:
    """Transcriber keyword arguments from the resource."""
    compute = archive.speech_compute_type
    if compute == "default":
        compute = "float16" if device == "cuda" else "int8"
    return {"device": device, "compute_type": compute, "vad": archive.speech_vad, "language": archive.speech_language}


@batch_asset(
    "transcripts",
    TRANSCRIPTS,
    kinds=("ray", "mlflow"),
    deps=["video_metadata", "speech_model"],
    pool=ACCELERATOR_POOL,
)
def transcripts(
    context: AssetExecutionContext,
    batch: str,
    config: TranscriptsConfig,
    archive: ArchiveSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
) -> MaterializeResult:
    """Speech segments with word times (Whisper through faster-whisper, voice-activity filtered), one Ray
    Data job per batch: 1-CPU tasks decode audio, model actors transcribe. A video without an audio
    stream, or without speech, gets one row that says so and no text; one that fails gets an error row.
    The speech model version is resolved here and recorded (``model_version``) for the stages after."""
    meta = tables.batch(VIDEO_METADATA, batch, SCHEMAS[VIDEO_METADATA])
    if meta.is_empty():
        raise Failure(f"video_metadata has no rows for batch {batch!r}: materialise it first")
    model, version = archive_model_files(mlflow_registry, archive, SPEECH)
    name = archive.registered_model(SPEECH)
    existing = tables.batch(TRANSCRIPTS, batch, SCHEMAS[TRANSCRIPTS]).filter(pl.col("model_version") == version)
    done = set(existing.get_column("video_id").to_list())
    # Probe rejects are transcribed too: a file with a broken video stream may still carry speech.
    todo = meta if config.retranscribe else meta.filter(~pl.col("video_id").is_in(done))
    spec, device = archive.stage_spec(cluster_gpus(), batch_size=1, kind=SPEECH)
    context.log.info(
        f"batch {batch}: {todo.height} videos to transcribe with models:/{name}@{archive.alias} v{version} "
        f"on {device}, {meta.height - todo.height} already transcribed"
    )
    started, written, audio_s, busy_s, decode_s = time.perf_counter(), 0, 0.0, 0.0, 0.0
    videos = todo.select("video_id", "batch_key", "uri").to_dicts()
    arrived: dict[str, list[dict]] = {}
    ready: list[dict] = []
    rows_iter = transcript_job_rows(videos, model, whisper_settings(archive, device), name, version, spec)
    for row in rows_iter:
        rows = arrived.setdefault(row["video_id"], [])
        rows.append(row)
        if len(rows) < int(row["segments_of_video"]):
            continue
        video_rows = list({int(r["segment"]): r for r in arrived.pop(row["video_id"])}.values())
        audio_s += row["audio_s"]
        busy_s += row["transcribe_s"]
        decode_s += row["decode_s"]
        label = printable(row["uri"].rsplit("/", 1)[-1])
        if row["status"] == TRANSCRIPT_ERROR:
            context.log.warning(f"{label}: {printable(row['error'])}")
        else:
            said = sum(1 for r in video_rows if r["status"] == TRANSCRIPT_SPEECH)
            context.log.info(f"{label}: {said} speech segments ({row['status'] if not said else 'speech'})")
        ready.append(video_rows)
        if len(ready) >= WRITE_EVERY:
            written += _write(tables, ready, version)
            ready = []
    ready += list(arrived.values())  # a video Ray returned only part of: written as it came
    written += _write(tables, ready, version)
    wall_s = time.perf_counter() - started

    out = tables.batch(TRANSCRIPTS, batch, SCHEMAS[TRANSCRIPTS]).filter(pl.col("model_version") == version)
    speech = out.filter(pl.col("status") == TRANSCRIPT_SPEECH)
    return MaterializeResult(
        data_version=DataVersion(f"model-v{version}"),
        metadata={
            **table_metadata(
                tables.table_uri(TRANSCRIPTS),
                out,
                tables.row_count(TRANSCRIPTS),
                ["uri", "segment", "start_s", "end_s", "status", "text", "error"],
            ),
            "excerpt": MetadataValue.md(_excerpt(speech)),
            "model_uri": MetadataValue.text(f"models:/{name}@{archive.alias}"),
            "model_version": MetadataValue.text(version),
            "device": MetadataValue.text(device),
            "videos_transcribed": MetadataValue.int(todo.height),
            "videos_cached": MetadataValue.int(meta.height - todo.height),
            "rows_by_status": MetadataValue.json({k: int(v) for k, v in out.group_by("status").len().iter_rows()}),
            "rows_written": MetadataValue.int(written),
            "audio_s": MetadataValue.float(round(audio_s, 2)),
            "job_wall_s": MetadataValue.float(round(wall_s, 3)),
            "decode_s": MetadataValue.float(round(decode_s, 3)),
            "transcribe_busy_s": MetadataValue.float(round(busy_s, 3)),
            "real_time_factor": MetadataValue.float(round(busy_s / audio_s, 3) if audio_s else 0.0),
            "segments_per_s": MetadataValue.float(round(speech.height / wall_s, 2) if todo.height else 0.0),
        },
    )


def _write(tables: DeltaTables, videos: list[list[dict]], version: str) -> int:
    """Whole videos: in one commit, their rows for this model version are replaced by the new ones."""
    rows = [r for video in videos for r in video]
    if not rows:
        return 0
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[TRANSCRIPTS]]
    full = [
        {**{c: r.get(c) for c in cols}, "words": json.loads(r["words"]), "transcribed_at": now}
        | {"error": r.get("error") or None}
        for r in rows
    ]
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),
        "video_id": sorted({r["video_id"] for r in full}),
        "model_version": [version],
    }
    tables.replace_where(TRANSCRIPTS, to_arrow(TRANSCRIPTS, full), selection)
    return len(full)


def _excerpt(speech: pl.DataFrame) -> str:
    """A few videos' first lines, with their times."""
    lines = []
    for (uri,), rows in speech.sort("uri", "segment").group_by(["uri"], maintain_order=True):
        if len(lines) >= EXCERPT_VIDEOS:
            break
        said = " ".join(
            f"[{r['start_s']:.1f}–{r['end_s']:.1f}s] {r['text'].strip()}" for r in rows.head(3).iter_rows(named=True)
        )
        lines.append(f"**{printable(uri.rsplit('/', 1)[-1])}**: {printable(said)}")
    return "\n\n".join(lines) or "_no speech in this batch_"
