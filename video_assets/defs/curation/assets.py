"""Curation stage: every frame the captions saw, scored and kept or dropped (with the reason), the kept
ones cropped to their picture and stored as JPEG, optionally described by the VLM.

Per batch and idempotent: a video already curated under the same ``curation_version`` (a hash of the
thresholds, the image store and, when describing, the prompt and model version) is not curated again,
so a second materialisation writes nothing; other thresholds are a new version whose rows sit beside
the old ones (rows are keyed by it).
"""

import json
import time
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Literal

import polars as pl
from dagster import AssetExecutionContext, Config, DataVersion, Failure, MaterializeResult, MetadataValue, asset
from dagster_ray import RayResource
from pydantic import Field

from resources.curation import CurationStore
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import caption_frames
from video_assets.core.curation.export import export_frames
from video_assets.core.curation.job import DEFAULT_DESCRIBE_PROMPT, curated_rows, decode_image
from video_assets.core.curation.quality import CurationConfig
from video_assets.core.inference.stages import StageSpec, one_per
from video_assets.core.structuring.usecase import load as load_use_case
from video_assets.core.tables import CURATED_FRAMES, SCHEMAS, to_arrow
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CURATION_ERROR
from video_assets.defs.common import ACCELERATOR_POOL, batch_asset, stage_asset, table_metadata
from video_assets.defs.engines import actor_gpus, describer, model_files_of
from video_assets.defs.lineage import lineage_captions, with_sampled_frames

SHEET_VIDEOS = 4  # videos whose frames the contact sheet shows
WRITE_EVERY = 256  # rows per Delta write (whole videos)


class FramesConfig(Config):
    use_case: str | None = Field(
        default=None,
        description="Take thresholds and the description prompt from this use case's [curation] table "
        "(video_assets/usecases/<name>/usecase.toml); None: the defaults",
    )
    describe: bool = Field(default=False, description="Describe every kept frame with the VLM behind the alias")
    image_store: Literal["blob", "files"] = Field(
        default="blob", description="blob: JPEG bytes in the image column; files: JPEG files, path in image_uri"
    )
    recurate: bool = Field(default=False, description="Curate again videos this curation_version already did")

    def curation(self) -> tuple[CurationConfig, str]:
        if not self.use_case:
            return CurationConfig(), DEFAULT_DESCRIBE_PROMPT
        values = dict(load_use_case(self.use_case).curation)
        prompt = values.pop("describe_prompt", DEFAULT_DESCRIBE_PROMPT)
        return CurationConfig.from_dict(values), prompt


@batch_asset("curation", CURATED_FRAMES, kinds=("ray",), deps=["captions", "sampled_frames"], pool=ACCELERATOR_POOL)
def frames(
    context: AssetExecutionContext,
    batch: str,
    config: FramesConfig,
    vlm: VlmSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    curation: CurationStore,
    ray_cluster: RayResource,
) -> MaterializeResult:
    """Every frame the batch's captions saw (their JPEGs from sampled_frames), scored (sharpness,
    brightness, contrast, motion, black borders, perceptual hash) and kept or dropped with the reason
    (dark, washed_out, flat, blurry, static, duplicate); kept frames cropped to their picture as JPEG,
    and described by the VLM when `describe` is on. The captions, and the model version that describes,
    are those the captions step last wrote for the batch (lineage)."""
    cfg, prompt = config.curation()
    caps, pair = lineage_captions(context, tables, batch)
    engine, endpoint, described_by, extra = None, None, "none", {"image_store": config.image_store}
    if config.describe:
        model, model_version = model_files_of(mlflow_registry, vlm, pair.model_version), pair.model_version
        extra |= {"describe_prompt": prompt, "describer": f"{vlm.registered_model}/{model_version}"}
        engine, endpoint, described_by = describer(vlm, model)
    version = cfg.version(**extra)

    existing = tables.batch(CURATED_FRAMES, batch, SCHEMAS[CURATED_FRAMES])
    done = set(existing.filter(pl.col("curation_version") == version).get_column("video_id").to_list())
    todo, skipped = [], 0
    for video in caption_frames(caps):
        if video["reason"]:
            skipped += 1  # no frame was sampled: nothing to curate
            continue
        if video["video_id"] in done and not config.recurate:
            continue
        todo.append({k: video[k] for k in ("video_id", "batch_key", "uri")} | {"times": json.dumps(video["times"])})
    sources = with_sampled_frames(tables, batch, pair, todo)
    context.log.info(
        f"batch {batch}: {len(todo)} videos to curate (curation_version {version}), {len(done)} already "
        f"curated, {skipped} without captioned frames; frames of {sources['sampled_frames']} from sampled_frames, "
        f"{sources['decoded_again']} decoded again"
    )
    in_job = engine is not None and endpoint is None  # a model loaded in the job's actors
    gpus = actor_gpus(vlm, "transformers") if in_job else 0.0
    spec = StageSpec(vlm.cpu_concurrency, vlm.concurrency, gpus, vlm.batch_size, model_num_cpus=1 if in_job else 0)
    expected = {v["video_id"]: sum(len(ts) for ts in json.loads(v["times"]).values()) for v in todo}
    started, written, n_frames = time.perf_counter(), 0, 0
    open_video: dict[str, list[dict]] = {}
    pending: list[dict] = []
    sheet: list[tuple[str, list]] = []
    for row in curated_rows(todo, cfg, spec, engine, prompt, endpoint):
        vid = row["video_id"]
        open_video.setdefault(vid, []).append(row)
        n_frames += 1
        if row["reason"] == CURATION_ERROR:
            context.log.warning(f"{printable(row['uri'])}: {printable(row['error'] or '')}")
        if len({(r["segment"], r["frame"]) for r in open_video[vid]}) >= expected.get(vid, 1):
            done_rows = one_per(open_video.pop(vid), ("segment", "frame"))
            if len(sheet) < SHEET_VIDEOS:
                sheet.append((printable(done_rows[0]["uri"].rsplit("/", 1)[-1]), done_rows))
            pending += done_rows
        if len(pending) >= WRITE_EVERY:
            written += _write(tables, curation, pending, version, config.image_store)
            pending = []
    for rows in open_video.values():  # a video Ray returned only part of: written whole anyway
        pending += one_per(rows, ("segment", "frame"))
    written += _write(tables, curation, pending, version, config.image_store)
    wall_s = time.perf_counter() - started

    out = tables.batch(CURATED_FRAMES, batch, SCHEMAS[CURATED_FRAMES]).filter(pl.col("curation_version") == version)
    reasons = {k: int(v) for k, v in out.group_by("reason").len().sort("reason").iter_rows()}
    return MaterializeResult(
        data_version=DataVersion(f"curation-{version}"),
        metadata={
            **table_metadata(
                tables.table_uri(CURATED_FRAMES),
                out,
                tables.row_count(CURATED_FRAMES),
                ["uri", "segment", "frame", "timestamp_s", "kept", "reason", "sharpness", "brightness", "motion"],
            ),
            **_sheet(sheet),
            "curation_version": MetadataValue.text(version),
            **pair.metadata(),
            "curation_config": MetadataValue.json({**asdict(cfg), **extra}),
            # What described the kept frames: the caption model's Serve application, an engine in the job, or none.
            "describe_engine": MetadataValue.text(described_by),
            "rows_by_reason": MetadataValue.json(reasons),
            "frames_kept": MetadataValue.int(int(out.get_column("kept").sum()) if out.height else 0),
            "videos_curated": MetadataValue.int(len(todo)),
            # Where the frames came from: the captions' own JPEGs, or (older captions) the video decoded again.
            "frame_sources": MetadataValue.json(sources),
            "videos_cached": MetadataValue.int(len(done)),
            "rows_written": MetadataValue.int(written),
            "job_wall_s": MetadataValue.float(round(wall_s, 3)),
            "frames_per_s": MetadataValue.float(round(n_frames / wall_s, 2) if n_frames else 0.0),
        },
    )


def _write(tables: DeltaTables, store: CurationStore, rows: list[dict], version: str, image_store: str) -> int:
    """Whole videos at a time: their rows for this curation version replaced in one commit (image files
    first, so a row never names a file that is not there)."""
    if not rows:
        return 0
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[CURATED_FRAMES]]
    full = []
    for r in rows:
        row = {c: r.get(c) for c in cols} | {"curation_version": version, "curated_at": now, "image_uri": None}
        row["error"] = row["error"] or None
        if image_store == "files" and row["image"]:
            path = store.frame_path(version, r["video_id"], int(r["segment"]), int(r["frame"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(row["image"])
            tmp.replace(path)
            row["image"], row["image_uri"] = None, str(path)
        full.append(row)
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),
        "video_id": sorted({r["video_id"] for r in full}),
        "curation_version": [version],
    }
    tables.replace_where(CURATED_FRAMES, to_arrow(CURATED_FRAMES, full), selection)
    return len(full)


def _sheet(videos: list[tuple[str, list[dict]]]) -> dict:
    """A contact sheet of a few videos' frames: kept framed green, dropped red with the reason."""
    from video_assets.core.charts import markdown_image
    from video_assets.core.curation.sheet import contact_sheet

    rows = []
    for name, frames_ in videos:
        items = [
            (decode_image(r["thumb"]), float(r["timestamp_s"]), r["reason"], bool(r["kept"]))
            for r in sorted(frames_, key=lambda r: r["timestamp_s"])
            if r.get("thumb")
        ]
        if items:
            rows.append((name, items))
    if not rows:
        return {}
    return {"contact_sheet": MetadataValue.md(markdown_image(contact_sheet(rows), "kept (green) and dropped frames"))}


# --- training_export: the kept frames, their descriptions and image bytes as Parquet shards with a
# manifest, read from one version of the frames table (reproducible: export the same version again).
# Downstream of every batch of frames, materialised on demand (the export_training_frames job), so the
# UI shows which frames version each export was made from.


class ExportConfig(Config):
    table_version: int | None = Field(default=None, description="Delta version of the frames table; None: latest")
    curation_version: str | None = Field(default=None, description="Only rows of this curation_version; None: all")
    name: str | None = Field(
        default=None, description="Sub-folder of the exports folder; None: frames-v<table version>"
    )
    shard_rows: int = Field(default=1000, ge=1, description="Rows per Parquet shard")


@asset(
    deps=["frames"],
    description="The kept frames of one frames table version as Parquet shards and a manifest",
    **stage_asset("curation", kinds=("parquet",)),
)
def training_export(
    context: AssetExecutionContext, config: ExportConfig, tables: DeltaTables, curation: CurationStore
) -> MaterializeResult:
    if not tables.exists(CURATED_FRAMES):
        raise Failure("the frames table does not exist yet: materialise frames first", allow_retries=False)
    version = config.table_version if config.table_version is not None else tables.version(CURATED_FRAMES)
    name = config.name or f"frames-v{version}" + (f"-{config.curation_version}" if config.curation_version else "")
    out = curation.export_path(name)
    manifest = export_frames(
        tables.table_uri(CURATED_FRAMES),
        out,
        version=version,
        curation_version=config.curation_version,
        shard_rows=config.shard_rows,
        storage_options=tables.storage_options or None,
    )
    context.log.info(f"exported {manifest['rows']} frames of table version {version} to {out}")
    return MaterializeResult(
        metadata={
            "path": MetadataValue.path(str(out)),
            "table_version": MetadataValue.int(manifest["table_version"]),
            "rows": MetadataValue.int(manifest["rows"]),
            "shards": MetadataValue.int(len(manifest["shards"])),
            "exported_at": MetadataValue.text(datetime.now(UTC).isoformat()),
        }
    )
