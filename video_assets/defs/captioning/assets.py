"""Captioning stage asset: one Ray Data job per batch, model and prompt resolved through MLflow aliases."""

import polars as pl
from dagster import AssetExecutionContext, AssetSpec, Config, DataVersion, Failure, MaterializeResult, MetadataValue
from dagster_ray import RayResource
from pydantic import Field

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import caption_versions, captioned_ok, split_key
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.tables import CAPTIONS, SAMPLED_FRAMES, SCHEMAS, VIDEO_METADATA
from video_assets.core.throughput import calibrated_cpu_to_accelerator
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CAPTION_ERROR
from video_assets.defs.caption_job import calibration_runs, run_captioning
from video_assets.defs.common import ACCELERATOR_POOL, CostBreakdown, batch_asset, stage_asset, table_metadata
from video_assets.defs.engines import captions_job_spec, preflight, resolve_caption_model
from video_assets.defs.partitions import video_batches
from video_assets.defs.ray_session import ray_dashboard
from video_assets.defs.registry import TINY_WARNING


class CaptionsConfig(Config):
    fps: float = Field(default=1.0, gt=0, description="Frames per second sampled")
    min_frames: int = Field(default=8, ge=1, description="Floor for short clips")
    max_frames: int = Field(default=16, ge=1, description="Cap per segment")
    segment_s: float | None = Field(default=None, description="Split videos into clips of this many seconds")
    scene_split: bool = Field(default=False, description="Split videos at scene cuts")
    keyframe_snap_s: float = Field(
        default=0.0,
        ge=0,
        description="0: exact frames; else a sampled frame may move to a keyframe this many seconds away (cheaper)",
    )
    screen_frames: bool = Field(
        default=True,
        description="Replace a black, blank, smeared or frozen sampled frame with the nearest useful one after it "
        "(never drops a frame; what was replaced is in sampled_frames.screened)",
    )
    recaption: bool = Field(default=False, description="Caption again videos already captioned by this model+prompt")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(
            fps=self.fps,
            min_frames=self.min_frames,
            max_frames=self.max_frames,
            segment_s=self.segment_s,
            scene_split=self.scene_split,
            keyframe_snap_s=self.keyframe_snap_s,
            **({} if self.screen_frames else {"screen": None}),
        )


def _skipped_rows(meta: pl.DataFrame) -> list[dict]:
    """Videos the probe rejected: an error row each, so none is silently missing."""
    return [
        {
            "video_id": vid,
            "batch_key": batch,
            "uri": uri,
            "segment": 0,
            "frame_timestamps": [],
            "prose": "",
            "status": CAPTION_ERROR,
            "error": f"not captioned: probe failed: {err}",
        }
        for vid, batch, uri, err in meta.select("video_id", "batch_key", "uri", "error").iter_rows()
    ]


# Written by the captions step beside its own table (the JPEGs each caption was made from, for the later frame
# stages): a table of the graph for its lineage. Not reported as materialised: an extra materialisation from the
# captions step is one more event on that step, which every reader of "the captions step's materialisation" (run
# results, the calibration) would have to tell apart; a multi-asset step is the way to report it (not done).
sampled_frames = AssetSpec(
    SAMPLED_FRAMES,
    deps=[CAPTIONS],
    partitions_def=video_batches,
    **stage_asset("captioning", SAMPLED_FRAMES),
    description="The sampled frames (JPEG) each ok caption was made from, a row each; written by the captions "
    "step, read by frames and frame_embeddings instead of decoding the video again.",
)


# A backfill's range of batches is one step and one Ray job: Ray, the engine actors and the model start
# once, not once a batch (docs/benchmarks.md). A sensor's run is one batch.
@batch_asset(
    "captioning",
    CAPTIONS,
    kinds=("ray", "mlflow"),
    deps=["video_metadata", "vlm_model", "caption_prompt"],
    pool=ACCELERATOR_POOL,
)
def captions(
    context: AssetExecutionContext,
    batches: list[str],
    config: CaptionsConfig,
    vlm: VlmSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    ray_cluster: RayResource,
    structurer: StructurerSettings,
) -> MaterializeResult:
    """Timestamped prose per video (or per clip) from the VLM behind the MLflow alias, computed by one
    Ray Data streaming job: a wide CPU stage decodes and samples frames, a narrow VLM stage captions.
    ``structurer`` is held only for its start-up check: a misspelt use case fails the run here, before
    the job, instead of in structured_events after it.
    Rows are merged on (video_id, segment, model_version, prompt_version), so reruns are idempotent.
    The model and prompt versions are resolved here, once, and recorded: every later stage of the
    batch works on these captions (``lineage.upstream_pair``). A backfill's range is one job."""
    batch = batches[0] if len(batches) == 1 else f"{batches[0]}...{batches[-1]} ({len(batches)} batches)"
    cost = CostBreakdown(context)
    with cost.part("delta"):
        meta = tables.batches(VIDEO_METADATA, batches, SCHEMAS[VIDEO_METADATA])
    probed = set(meta.get_column("batch_key"))
    missing = [b for b in batches if b not in probed]
    if missing:
        raise Failure(f"video_metadata has no rows for batch {', '.join(map(repr, missing))}: materialise it first")
    with cost.part("resolve_model"):
        model, pair, prompt = resolve_caption_model(mlflow_registry, vlm)
    model_version = pair.model_version
    # The engine and how it is reached, chosen once; vLLM's decode stage is sized by the throughput model,
    # calibrated on earlier vLLM batches.
    spec = captions_job_spec(
        vlm,
        model,
        prompt.template,
        config.sampling(),
        lambda engine: calibrated_cpu_to_accelerator(calibration_runs(context.instance, engine)),
    )
    engine = spec.engine.name
    context.log.info(
        f"models:/{vlm.registered_model}@{vlm.alias} -> v{model_version}, prompt v{prompt.version}, engine {engine} "
        f"({spec.transport.value})"
    )
    if vlm.is_tiny:
        context.log.warning(TINY_WARNING)

    with cost.part("delta"):
        existing = tables.batches(CAPTIONS, batches, SCHEMAS[CAPTIONS])  # a video's rows are in its batch
    done = captioned_ok(existing, model_version, prompt.version, split_key(config.sampling()))
    good = meta.filter(pl.col("ok"))
    todo = good if config.recaption else good.filter(~pl.col("video_id").is_in(done))
    context.log.info(
        f"batch {batch}: {todo.height} videos to caption, {good.height - todo.height} cached, "
        f"{meta.height - good.height} rejected by the probe"
    )
    if todo.height:
        preflight(spec)
    stamp = {
        "model_name": vlm.registered_model,
        "model_version": model_version,
        "prompt_version": prompt.version,
        "engine": engine,
    }
    stats = run_captioning(context.log, tables, todo, spec, stamp, _skipped_rows(meta.filter(~pl.col("ok"))))
    written, wall_s, cpu_s, engine_s = stats["written"], stats["wall_s"], stats["cpu_s"], stats["engine_s"]
    cost.add("job_startup", stats["first_row_s"])
    cost.add("job_streaming", wall_s - stats["first_row_s"] - stats["delta_s"])
    cost.add("delta", stats["delta_s"])

    with cost.part("delta"):
        out = tables.batches(CAPTIONS, batches, SCHEMAS[CAPTIONS]).filter(
            caption_versions(model_version, prompt.version)
        )
        table_rows = tables.row_count(CAPTIONS)
    errors = out.filter(pl.col("status") == CAPTION_ERROR)
    strips = _thumbnails(stats["previews"])
    return MaterializeResult(
        data_version=DataVersion(f"model-v{model_version}-prompt-v{prompt.version}"),
        metadata={
            **({"sampled_frames": MetadataValue.md(strips)} if strips else {}),
            **table_metadata(
                tables.table_uri(CAPTIONS), out, table_rows, ["uri", "segment", "status", "prose", "error"]
            ),
            "model_uri": MetadataValue.text(f"models:/{vlm.registered_model}@{vlm.alias}"),
            **pair.metadata(),
            "engine": MetadataValue.text(engine),
            # Served (the application and its replicas) or in-job engines: what answered this batch.
            "engine_service": MetadataValue.json(stats["service"]),
            **ray_dashboard(ray_cluster),
            **(
                {"calibrated_cpu_to_accelerator": MetadataValue.float(round(spec.cpu_to_accelerator, 3))}
                if spec.cpu_to_accelerator
                else {}
            ),
            "batches": MetadataValue.int(len(batches)),
            "videos_captioned": MetadataValue.int(todo.height),
            "videos_cached": MetadataValue.int(good.height - todo.height),
            "error_rows": MetadataValue.int(errors.height),
            "rows_written": MetadataValue.int(int(written)),
            "job_wall_s": MetadataValue.float(round(wall_s, 3)),
            "cpu_stage_s": MetadataValue.float(round(cpu_s, 3)),
            "engine_busy_s": MetadataValue.float(round(engine_s, 3)),
            "ray_nodes": MetadataValue.json(stats["nodes"]),
            # Where the step's time went: set-up (Ray), model resolution, Delta, the job's start-up
            # (actors, model load) and streaming; busy figures overlap the wall time.
            "cost_breakdown": cost.metadata(decode_cpu=cpu_s, generation=engine_s),
            # What the throughput model (`video-assets predict`) calibrates on.
            "video_s": MetadataValue.float(round(float(todo.get_column("duration_s").fill_null(0).sum() or 0), 3)),
            "requests": MetadataValue.int(int(stats["requests"])),
            # The sampled frames as JPEG (core.media.frames): what a segment put through Ray's object store.
            "frame_mb_per_segment": MetadataValue.float(
                round(stats["frame_bytes"] / max(1, int(stats["requests"])) / 1e6, 3)
            ),
            "output_tokens": MetadataValue.int(int(out.get_column("output_tokens").sum() or 0)),
            # Frames screened before the engine (core.media.screening): replaced (to_s) or flagged and kept.
            "frames_screened": MetadataValue.int(sum(s["to_s"] is not None for s in stats["screened"])),
            **({"screening": MetadataValue.md(_screened_table(stats["screened"]))} if stats["screened"] else {}),
        },
    )


def _screened_table(screened: list[dict], limit: int = 50) -> str:
    """The screened frames as markdown, replaced ones first (at most ``limit`` rows)."""
    rows = sorted(screened, key=lambda s: (s["to_s"] is None, s["uri"], s["segment"], s["frame"]))
    lines = [
        "| video | segment | frame | reason | planned frame at s | replaced by frame at s |",
        "|---|---|---|---|---|---|",
    ]
    for s in rows[:limit]:
        to = "kept (no useful frame near)" if s["to_s"] is None else f"{s['to_s']:.3f}"
        name = printable(s["uri"].rsplit("/", 1)[-1])
        lines.append(f"| {name} | {s['segment']} | {s['frame']} | {s['reason']} | {s['from_s']:.3f} | {to} |")
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more")
    return "\n".join(lines)


def _thumbnails(previews: list[tuple[str, int, bytes]]) -> str:
    """Markdown with the strips of frames the model saw (made by the job's decode stage)."""
    from video_assets.core.charts import markdown_image

    return "\n\n".join(
        f"**{printable(uri.rsplit('/', 1)[-1])}** (segment 0, {n} frames)\n\n{markdown_image(jpeg, 'sampled frames')}"
        for uri, n, jpeg in previews
    )
