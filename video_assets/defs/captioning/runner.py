"""Captioning runs, shared by the captions asset and the promotion job: the Ray job spec from the
resources and run config, and the streaming write of its rows into the captions table."""

import time
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from dagster import Failure

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.settings import ray_outlives_steps
from resources.vlm import VlmSettings
from video_assets.core.captioning.job import EngineSpec, JobSpec, caption_rows
from video_assets.core.captioning.versions import caption_versions, split_key
from video_assets.core.inference import choose_engine_name
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.service_runner import streamed
from video_assets.core.inference.vllm import check_frames
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.tables import CAPTIONS, SCHEMAS, to_arrow
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

PREVIEW_VIDEOS = 3  # videos whose sampled frames the materialisation shows
WRITE_EVERY = 32  # rows per Delta merge (whole videos): a crash loses at most this much work


def cluster_gpus() -> float | None:
    """GPUs of the Ray cluster this process is connected to; None when Ray is not started here."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else None


def engine_name(vlm: VlmSettings) -> str:
    """``auto`` asks the cluster, not this process: a CPU-only orchestrator may drive GPU workers."""
    return choose_engine_name(vlm.engine, gpus=cluster_gpus())


def actor_gpus(vlm: VlmSettings, engine: str) -> float:
    """GPUs a transformers actor reserves, so Ray counts what it uses (vLLM places its own engines)."""
    if engine != "transformers":
        return 0.0
    if vlm.vlm_num_gpus is not None:
        return vlm.vlm_num_gpus
    return 1.0 if vlm.device != "cpu" and (cluster_gpus() or 0) > 0 else 0.0


def registered_model_files(registry: MlflowRegistry, vlm: VlmSettings, alias: str) -> tuple[ModelFiles, str]:
    """The version behind ``alias`` downloaded for this step, with what other nodes need to fetch it
    themselves; and the version."""
    return registry.model_files(vlm.registered_model, alias, Path(vlm.cache_dir) / "registry", vlm.cache_dir)


def job_spec(
    sampling: SamplingConfig, vlm: VlmSettings, engine: str, model: ModelFiles, prompt_template: str
) -> JobSpec:
    """The Ray job of a captioning run; a plan vLLM cannot honour is a Failure before anything starts."""
    try:
        vllm_settings = vlm.vllm_settings(model.path)
        if engine == "vllm":
            check_frames(vllm_settings, sampling.max_frames)
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    return JobSpec(
        sampling=sampling,
        engine=EngineSpec(
            engine,
            model,
            vlm.device,
            vlm.vlm_batch_size,
            vlm.max_new_tokens,
        ),
        prompt=prompt_template,
        cpu_concurrency=vlm.cpu_concurrency,
        vlm_concurrency=vlm.vlm_concurrency,
        vlm_num_gpus=actor_gpus(vlm, engine),
        cpu_resources=dict(vlm.decode_resources),
        vlm_resources=dict(vlm.vlm_resources),
        vllm=vllm_settings.model_dump(),
        warm_idle_s=vlm.warm_engine_idle_s if engine == "transformers" and ray_outlives_steps() else 0.0,
    )


def warm_engine_spec(vlm: VlmSettings, model: ModelFiles) -> JobSpec | None:
    """The spec that names the captions step's warm transformers engine for ``model`` (what another
    step needs to use the same loaded engine), or None when engines are not kept warm (no Ray that
    outlives the steps)."""
    spec = job_spec(SamplingConfig(), vlm, "transformers", model, "")
    return spec if spec.warm_idle_s > 0 else None


def run_captioning(
    log, tables: DeltaTables, todo: pl.DataFrame, spec: JobSpec, stamp: dict, pending: list[dict] | None = None
) -> dict:
    """Caption ``todo`` (video_metadata rows) with one Ray Data job. Rows are written whole videos at a
    time (merged every WRITE_EVERY rows), each write replacing everything the video had for this model
    and prompt, so a crash between writes never leaves a video half captioned, and stale segments of an
    earlier split go. ``pending`` rows (e.g. probe rejects) are written with the first merge."""
    started = time.perf_counter()
    split = split_key(spec.sampling)
    ready = [{**r, "segments": 1} for r in pending or []]
    arrived: dict[str, dict[int, dict]] = {}  # video -> segment -> row, until every planned segment is in
    written = cpu_s = engine_s = delta_s = 0.0
    first_row_s = None  # Ray Data start-up, actor spawn, model load and the first batch
    nodes: dict[str, set[str]] = {"decode": set(), "engine": set()}  # Ray node ids each stage ran on
    previews: list[tuple[str, int, bytes]] = []  # (uri, frames, JPEG) of the first videos' segment 0
    videos = todo.select("video_id", "batch_key", "uri", "duration_s", "rotation").to_dicts()
    n_rows = 0
    # In the long-lived local Ray's job runner when it runs (warm workers); a vLLM job stays in the
    # step, where its processor and model placement are tested (make test-vllm-cpu).
    jobs = caption_rows(videos, spec) if spec.engine.name == "vllm" else streamed(caption_rows, videos, spec)
    for n_rows, row in enumerate(jobs if videos else [], start=1):
        if first_row_s is None:
            first_row_s = time.perf_counter() - started
        name = printable(row["uri"].rsplit("/", 1)[-1])
        if row["status"] == CAPTION_OK:
            log.info(
                f"[{n_rows}] {name} segment {row['segment']}: {row['output_tokens']} tokens in {row['latency_s']:.2f}s"
            )
        else:
            log.warning(f"[{n_rows}] {name}: {printable(row['error'])}")
        cpu_s += row.get("decode_s") or 0.0
        engine_s += row.get("engine_s") or 0.0
        for stage in nodes:
            if row.get(f"{stage}_node"):
                nodes[stage].add(row[f"{stage}_node"])
        if row.get("preview") and len(previews) < PREVIEW_VIDEOS:
            previews.append((row["uri"], len(row.get("frame_timestamps") or []), row["preview"]))
        segments = arrived.setdefault(row["video_id"], {})
        segments[int(row["segment"])] = row  # a segment Ray computed twice (a retried task) is kept once
        if len(segments) >= (row.get("segments") or 1):
            ready.extend(arrived.pop(row["video_id"]).values())
            if len(ready) >= WRITE_EVERY:
                t0 = time.perf_counter()
                written += _write(tables, ready, stamp, split)
                delta_s += time.perf_counter() - t0
                ready = []
    for segments in arrived.values():  # the job ended without some segments: say so, per segment
        planned = max(int(r.get("segments") or 1) for r in segments.values())
        some = next(iter(segments.values()))
        missing = [i for i in range(planned) if i not in segments]
        log.warning(f"{printable(some['uri'])}: no result for segments {missing}; written as error rows")
        ready.extend(segments.values())
        ready.extend(
            {**{k: some.get(k) for k in ("video_id", "batch_key", "uri", "segments")}, "segment": i}
            | {"frame_timestamps": [], "prose": "", "status": CAPTION_ERROR, "error": "the job returned no result"}
            for i in missing
        )
    t0 = time.perf_counter()
    written += _write(tables, ready, stamp, split)
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
    }


def _write(tables: DeltaTables, rows: list[dict], stamp: dict, split: str) -> int:
    """Write whole videos: in one commit, their rows for this model and prompt are replaced by ``rows``
    (a rerun's rows, or another split's, leave nothing stale behind)."""
    if not rows:
        return 0
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[CAPTIONS]]
    full = [{**{c: r.get(c) for c in cols}, **stamp, "split": split, "captioned_at": now} for r in rows]
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),  # lets Delta skip other batches' files
        "video_id": sorted({r["video_id"] for r in full}),
        "model_version": [str(stamp["model_version"])],
        "prompt_version": [int(stamp["prompt_version"])],
    }
    tables.replace_where(CAPTIONS, to_arrow(CAPTIONS, full), selection)
    return len(full)


def batch_captions(tables: DeltaTables, batch: str, model_version: str, prompt_version: int) -> pl.DataFrame:
    """The batch's captions by one (model, prompt) pair."""
    return tables.batch(CAPTIONS, batch, SCHEMAS[CAPTIONS]).filter(caption_versions(model_version, prompt_version))


def production_captions(
    tables: DeltaTables, batch: str, vlm: VlmSettings, mlflow_registry: MlflowRegistry
) -> tuple[pl.DataFrame, str, int]:
    """The batch's captions by the production model and prompt, with those versions; a Failure that says
    what to run when the batch has none yet (the stages that read captions start here)."""
    from video_assets.defs.models.assets import production_versions

    model_version, prompt_version = production_versions(vlm, mlflow_registry)
    caps = batch_captions(tables, batch, model_version, prompt_version)
    if caps.is_empty():
        raise Failure(f"captions has no rows for batch {batch!r} (model v{model_version}): materialise it first")
    return caps, model_version, prompt_version
