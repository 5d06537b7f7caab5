"""Embeddings stage assets: a vector per caption frame, and per transcript segment and caption.

Both are per batch and idempotent: a video (frames) or a source row (texts) already embedded by the
encoder version behind the alias is not embedded again, so a second materialisation writes nothing, and
a new encoder version embeds everything again under its own version (old rows stay, keyed by theirs).
"""

import json
import time
from datetime import UTC, datetime

import polars as pl
from dagster import AssetExecutionContext, Config, DataVersion, MaterializeResult, MetadataValue
from dagster_ray import RayResource
from pydantic import Field

from resources.archive import FRAMES, TEXT, ArchiveSettings
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from video_assets.core.captioning.versions import caption_frames, caption_source_version
from video_assets.core.embeddings.job import frame_embedding_rows, text_embedding_rows
from video_assets.core.inference.stages import one_per
from video_assets.core.tables import FRAME_EMBEDDINGS, KEYS, SCHEMAS, TEXT_EMBEDDINGS, TRANSCRIPTS, to_arrow
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CAPTION_OK, EMBED_ERROR, SOURCE_CAPTION, SOURCE_TRANSCRIPT, TRANSCRIPT_SPEECH
from video_assets.defs.common import ACCELERATOR_POOL, batch_asset, table_metadata
from video_assets.defs.lineage import CaptionPair, lineage_captions, upstream_value, with_sampled_frames
from video_assets.defs.ray_session import cluster_gpus
from video_assets.defs.registry import archive_model_files

PLOT_VIDEOS = 6  # videos whose frames the materialisation plots in 2-D
FRAME_KEY = ("segment", "frame")  # a video's rows, one per frame
WRITE_EVERY = 256  # rows per Delta write (whole videos for frames)


class EmbedConfig(Config):
    reembed: bool = Field(default=False, description="Embed again what this encoder version already embedded")


def _stamp(rows: list[dict], table: str, **extra) -> list[dict]:
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[table]]
    return [{**{c: r.get(c) for c in cols}, **extra, "embedded_at": now} for r in rows]


@batch_asset(
    "embeddings",
    FRAME_EMBEDDINGS,
    kinds=("ray", "mlflow"),
    deps=["captions", "sampled_frames", "frame_encoder"],
    pool=ACCELERATOR_POOL,
)
def frame_embeddings(
    context: AssetExecutionContext,
    batch: str,
    config: EmbedConfig,
    archive: ArchiveSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
) -> MaterializeResult:
    """A vector per frame the captions saw (same timestamps), from the frame encoder behind the alias
    (EfficientNet-Lite0 by default: frame-to-frame similarity; a CLIP-style model: text queries too),
    with on-screen text when `frame_ocr` is on. A video whose frames cannot be decoded gets an error row.
    The captions are those the captions step last wrote for the batch (lineage)."""
    model, version = archive_model_files(mlflow_registry, archive, FRAMES)
    encoder = archive.registered_model(FRAMES)
    caps, pair = lineage_captions(context, tables, batch)
    existing = tables.batch(FRAME_EMBEDDINGS, batch, SCHEMAS[FRAME_EMBEDDINGS])
    done = set(existing.filter(pl.col("encoder_version") == version).get_column("video_id").to_list())
    todo, failed = [], []
    for video in caption_frames(caps):
        if video["video_id"] in done and not config.reembed:
            continue
        ids = {k: video[k] for k in ("video_id", "batch_key", "uri")}
        if video["reason"]:
            failed.append(ids | _error_row(video["reason"]))
        else:
            todo.append(ids | {"times": json.dumps(video["times"])})
    sources = with_sampled_frames(tables, batch, pair, todo)
    context.log.info(
        f"batch {batch}: {len(todo)} videos to embed with models:/{encoder}@{archive.alias} v{version}, "
        f"{len(done)} already embedded, {len(failed)} without captioned frames; frames of "
        f"{sources['sampled_frames']} from sampled_frames, {sources['decoded_again']} decoded again"
    )
    # One segment (its frames) per call; the encoder batches frames.
    spec, device = archive.stage_spec(cluster_gpus(), 1, FRAMES)
    started, pending, written, frames, encode_s, errors = time.perf_counter(), list(failed), 0, 0, 0.0, len(failed)
    open_video: dict[str, list[dict]] = {}
    expected = {v["video_id"]: len(json.loads(v["times"])) for v in todo}
    seen: dict[str, set[int]] = {}
    for row in frame_embedding_rows(todo, model, device, archive.frame_ocr, archive.frame_batch_size, spec):
        vid = row["video_id"]
        open_video.setdefault(vid, []).append(row)
        seen.setdefault(vid, set()).add(int(row["segment"]))
        if row["status"] == EMBED_ERROR:
            errors += 1
            context.log.warning(f"{printable(row['uri'])}: {printable(row['error'])}")
            expected[vid] = len(seen[vid])  # an undecodable video is one error row
        else:
            frames += 1
            encode_s += row.get("encode_s") or 0.0
        if len(seen[vid]) >= expected.get(vid, 1):
            pending += one_per(open_video.pop(vid), FRAME_KEY)
        if len(pending) >= WRITE_EVERY:
            written += _write_frames(tables, pending, encoder, version)
            pending = []
    for rows in open_video.values():  # a video Ray returned only part of: written whole anyway
        pending += one_per(rows, FRAME_KEY)
    written += _write_frames(tables, pending, encoder, version)
    wall_s = time.perf_counter() - started

    out = tables.batch(FRAME_EMBEDDINGS, batch, SCHEMAS[FRAME_EMBEDDINGS]).filter(pl.col("encoder_version") == version)
    return MaterializeResult(
        data_version=DataVersion(f"encoder-v{version}"),
        metadata={
            **table_metadata(
                tables.table_uri(FRAME_EMBEDDINGS),
                out,
                tables.row_count(FRAME_EMBEDDINGS),
                ["uri", "segment", "frame", "timestamp_s", "status", "dim", "error"],
            ),
            **_plot(out),
            "encoder_uri": MetadataValue.text(f"models:/{encoder}@{archive.alias}"),
            "encoder_version": MetadataValue.text(version),
            **pair.metadata(),
            "videos_embedded": MetadataValue.int(len(todo)),
            # Where the frames came from: the captions' own JPEGs, or (older captions) the video decoded again.
            "frame_sources": MetadataValue.json(sources),
            "videos_cached": MetadataValue.int(len(done)),
            "frames_embedded": MetadataValue.int(frames),
            "error_rows": MetadataValue.int(errors),
            "rows_written": MetadataValue.int(written),
            "job_wall_s": MetadataValue.float(round(wall_s, 3)),
            "frames_per_s": MetadataValue.float(round(frames / wall_s, 2) if frames else 0.0),
            "encoder_ms_per_frame": MetadataValue.float(round(1000 * encode_s / frames, 1) if frames else 0.0),
        },
    )


def _error_row(reason: str) -> dict:
    return {"segment": 0, "frame": 0, "status": EMBED_ERROR, "error": reason}


def _write_frames(tables: DeltaTables, rows: list[dict], encoder: str, version: str) -> int:
    """Whole videos at a time: their rows for this encoder version replaced in one commit."""
    if not rows:
        return 0
    full = _stamp(rows, FRAME_EMBEDDINGS, encoder=encoder, encoder_version=version)
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),
        "video_id": sorted({r["video_id"] for r in full}),
        "encoder_version": [version],
    }
    tables.replace_where(FRAME_EMBEDDINGS, to_arrow(FRAME_EMBEDDINGS, full), selection)
    return len(full)


def _plot(out: pl.DataFrame) -> dict:
    """A 2-D projection of a few videos' frame vectors: clips should form their own clusters."""
    from video_assets.core.charts import markdown_image
    from video_assets.core.embeddings.similarity import project_2d, scatter_png

    ok = out.filter(pl.col("embedding").is_not_null())
    videos = ok.get_column("uri").unique(maintain_order=True).head(PLOT_VIDEOS).to_list()
    ok = ok.filter(pl.col("uri").is_in(videos))
    if ok.height < 3:
        return {}
    import numpy as np

    points = project_2d(np.asarray(ok.get_column("embedding").to_list(), dtype=np.float32))
    labels = [printable(u.rsplit("/", 1)[-1]) for u in ok.get_column("uri").to_list()]
    return {"frame_map": MetadataValue.md(markdown_image(scatter_png(points, labels), "frames in 2-D (PCA)"))}


@batch_asset(
    "embeddings",
    TEXT_EMBEDDINGS,
    kinds=("ray", "mlflow"),
    deps=["transcripts", "captions", "text_encoder"],
    pool=ACCELERATOR_POOL,
)
def text_embeddings(
    context: AssetExecutionContext,
    batch: str,
    config: EmbedConfig,
    archive: ArchiveSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
) -> MaterializeResult:
    """A vector per transcript segment and per caption, keyed back to its source row and time range:
    the transcripts and captions the batch's upstream steps last wrote (their versions through lineage)."""
    model, version = archive_model_files(mlflow_registry, archive, TEXT)
    encoder = archive.registered_model(TEXT)
    speech_version = upstream_value(context, TRANSCRIPTS, batch, "model_version")
    caps, pair = lineage_captions(context, tables, batch)
    sources = _text_sources(tables, batch, speech_version, caps, pair)
    key = ["video_id", "source", "segment", "source_version"]
    existing = tables.batch(TEXT_EMBEDDINGS, batch, SCHEMAS[TEXT_EMBEDDINGS]).filter(
        pl.col("encoder_version") == version
    )
    todo = sources if config.reembed else sources.join(existing.select(key), on=key, how="anti")
    context.log.info(
        f"batch {batch}: {todo.height} texts to embed with models:/{encoder}@{archive.alias} v{version}, "
        f"{sources.height - todo.height} already embedded"
    )
    spec, device = archive.stage_spec(cluster_gpus(), archive.text_batch_size, TEXT)
    started, written, encode_s = time.perf_counter(), 0, 0.0
    pending: list[dict] = []
    for row in text_embedding_rows(todo.to_dicts(), model, device, spec):
        encode_s += row.get("encode_s") or 0.0
        pending.append(row)
    for i in range(0, len(pending), WRITE_EVERY):
        # A keyed upsert: a rerun's rows replace their own, and nothing else of the video is touched.
        chunk = _stamp(pending[i : i + WRITE_EVERY], TEXT_EMBEDDINGS, encoder=encoder, encoder_version=version)
        tables.merge(TEXT_EMBEDDINGS, to_arrow(TEXT_EMBEDDINGS, chunk), KEYS[TEXT_EMBEDDINGS])
        written += len(chunk)
    wall_s = time.perf_counter() - started
    out = tables.batch(TEXT_EMBEDDINGS, batch, SCHEMAS[TEXT_EMBEDDINGS]).filter(pl.col("encoder_version") == version)
    counts = dict(out.group_by("source").len().iter_rows())
    return MaterializeResult(
        data_version=DataVersion(f"encoder-v{version}"),
        metadata={
            **table_metadata(
                tables.table_uri(TEXT_EMBEDDINGS),
                out,
                tables.row_count(TEXT_EMBEDDINGS),
                ["uri", "source", "segment", "start_s", "end_s", "text"],
            ),
            "encoder_uri": MetadataValue.text(f"models:/{encoder}@{archive.alias}"),
            "encoder_version": MetadataValue.text(version),
            "texts_embedded": MetadataValue.int(len(pending)),
            "texts_cached": MetadataValue.int(sources.height - todo.height),
            "rows_by_source": MetadataValue.json({k: int(v) for k, v in counts.items()}),
            **pair.metadata(),
            "speech_model_version": MetadataValue.text(str(speech_version)),
            "rows_written": MetadataValue.int(written),
            "job_wall_s": MetadataValue.float(round(wall_s, 3)),
            "texts_per_s": MetadataValue.float(round(len(pending) / wall_s, 2) if pending else 0.0),
            "encoder_ms_per_text": MetadataValue.float(round(1000 * encode_s / len(pending), 2) if pending else 0.0),
        },
    )


def _text_sources(
    tables: DeltaTables, batch: str, speech_version: str | None, caps: pl.DataFrame, pair: CaptionPair
) -> pl.DataFrame:
    """The batch's texts to embed: speech segments of ``speech_version`` (none when the batch has no
    transcripts) and the ok captions of ``caps`` (one caption pair)."""
    cols = ["video_id", "batch_key", "uri", "source", "segment", "source_version", "start_s", "end_s", "text"]
    said = tables.batch(TRANSCRIPTS, batch, SCHEMAS[TRANSCRIPTS]).filter(
        (pl.col("model_version") == speech_version)
        & (pl.col("status") == TRANSCRIPT_SPEECH)
        & (pl.col("text").str.len_chars() > 0)
    )
    seen = caps.filter((pl.col("status") == CAPTION_OK) & (pl.col("prose").fill_null("").str.len_chars() > 0))
    return pl.concat(
        [
            said.select(
                "video_id",
                "batch_key",
                "uri",
                pl.lit(SOURCE_TRANSCRIPT).alias("source"),
                "segment",
                pl.col("model_version").alias("source_version"),
                "start_s",
                "end_s",
                pl.col("text").str.strip_chars(),
            ),
            seen.select(
                "video_id",
                "batch_key",
                "uri",
                pl.lit(SOURCE_CAPTION).alias("source"),
                "segment",
                pl.lit(caption_source_version(pair.model_version, pair.prompt_version)).alias("source_version"),
                pl.col("segment_start_s").alias("start_s"),
                pl.col("segment_end_s").alias("end_s"),
                pl.col("prose").alias("text"),
            ),
        ]
    ).select(cols)
