"""The captioning Ray Data job: a wide CPU stage (decode + sample) feeding a narrow VLM stage.

    rows ─► repartition ─► flat_map(decode_and_sample, 1-CPU tasks) ─► map_batches(CaptionStage, actor pool)

On a Ray that outlives the step the VLM stage calls a Ray Serve application instead of loading the model
in the job (``core.serving.captioner``): the next batch, and structuring, reuse the loaded replica.

A video the CPU stage cannot decode stays in the stream as one row carrying ``decode_error``: the VLM
stage passes it through as a status=error row without running the engine (no side channel that a
retried task could double-report or lose). Every row carries ``segments``, the number of segments
planned for its video, so the writer knows when a video is whole.

Retries (Ray): a decode task is retried when its worker dies (reading a file twice is harmless; a
Python error is already an error row, so it is not retried). An engine actor that dies is always
started again, but the batch it died on is tried a bounded number of times and then dropped
(``engine_stage_options``, ``tolerate_failed_batches``): Ray Data's default retries it forever, which
loops on a video that crashes the engine every time. The consumer writes each segment of a dropped
batch as an error row (``defs.engines.run_captioning``), so the job finishes and nothing goes missing.

Kept free of Dagster so the stages can be driven and tested with plain Ray.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import ray

from video_assets.core import serving
from video_assets.core.captioning.batch import (
    RESULT_COLUMNS,
    EngineSpec,
    JobSpec,
    Transport,
    build_engine,
    caption_batch,
    node_id,
)
from video_assets.core.inference.retries import all_engines_first, engine_stage_options, tolerate_failed_batches
from video_assets.core.inference.stages import DECODE_TASK_RETRIES, cpu_task_slots
from video_assets.core.media import frames
from video_assets.core.media.sampling import SamplingConfig, SegmentStream
from video_assets.core.vocabulary import CAPTION_OK

# Ray Data hands a task's output on in blocks of up to 128 MiB (its default): a long video's segments
# (JPEGs, about 0.35 MB each) would wait in the decode task until all of them were decoded, and reach the
# engine together. Blocks of this size pass about 20 segments at a time, and bound the task's memory.
SEGMENT_BLOCK_BYTES = 8 << 20


def _preview(frames, timestamps) -> bytes:
    """A small JPEG strip of a segment's frames, so the asset can show what the model saw without
    decoding the video again; never fails the row."""
    from video_assets.core.charts import thumbnail_strip

    try:
        return thumbnail_strip(frames, timestamps)
    except Exception:
        return b""


def decode_and_sample(row: dict, sampling: SamplingConfig) -> Iterator[dict]:
    """CPU stage: one video in, one row per segment out, each as soon as it is decoded (its frames as JPEGs,
    ``core.media.frames``, and a preview strip on the first): a task holds one segment's frames whatever the
    video's length. A video that cannot be decoded is one row with ``decode_error`` set; one that fails
    part way gives its decoded segments and an error row for each planned one left."""
    started, node = time.perf_counter(), node_id()
    stream = SegmentStream(row["uri"], sampling, row.get("duration_s"), row.get("rotation"))
    done = 0
    try:
        for seg in stream:
            yield {
                **_ids(row),
                "segment": seg.index,
                "segments": stream.planned,
                "segment_start_s": float(seg.start_s),
                "segment_end_s": float(seg.end_s),
                "frame_timestamps": [float(t) for t in seg.timestamps],
                # JPEG from here on: ~15x fewer bytes through the object store; kept as sampled_frames too.
                "frames": frames.encode(seg.frames),
                "decode_s": time.perf_counter() - started,
                "decode_node": node,
                "decode_error": "",  # not None: a column of Nones reaches the VLM stage as float NaN
                "preview": _preview(seg.frames, seg.timestamps) if seg.index == 0 else b"",
                "screened": json.dumps(seg.screened) if seg.screened else "",
            }
            del seg  # its raw frames go before the next segment is decoded: one segment's pixels held at a time
            done, started = done + 1, time.perf_counter()
    except Exception as exc:  # one bad video becomes error rows, never a failed job
        error = f"{exc.__class__.__name__}: {exc}"
        for index in range(done, max(stream.planned, done + 1)):
            yield {
                **_ids(row),
                "segment": index,
                "segments": max(stream.planned, 1),
                "segment_start_s": 0.0,
                "segment_end_s": 0.0,
                "frame_timestamps": [],
                "frames": [],
                "decode_s": time.perf_counter() - started,
                "decode_node": node,
                "decode_error": error,
                "preview": b"",
                "screened": "",
            }


def _ids(row: dict) -> dict:
    return {"video_id": row["video_id"], "batch_key": row["batch_key"], "uri": row["uri"]}


class CaptionStage:
    """One engine per actor of the job's pool, loaded once per job; each call captions a batch."""

    def __init__(self, engine: EngineSpec, prompt: str):
        self.engine = build_engine(engine)
        self.prompt = prompt
        self.max_new_tokens = engine.max_new_tokens
        self.node = node_id()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        return caption_batch(self.engine, self.node, batch, self.prompt, self.max_new_tokens)


def decode_slots(spec: JobSpec, cluster_cpus: float | None = None) -> int:
    """The captioning job's decode tasks: ``cpu_task_slots`` beside transformers actors; beside vLLM, the
    cluster's CPUs its engines and Ray's CPU stages leave (``vllm_decode_workers``), raised to what keeps
    the engines busy by the calibrated throughput model (``decode_width``: Ray Data scales the tasks
    that run to the CPUs of the moment, so the pool grows with the cluster up to that width).
    ``cluster_cpus``: the connected cluster's by default."""
    if spec.vlm_resources or spec.cpu_resources:
        return spec.cpu_concurrency  # pinned stages: the cluster total says nothing
    if spec.engine.name == "vllm":
        from video_assets.core.inference.vllm import VllmSettings
        from video_assets.core.throughput import decode_width, vllm_decode_workers

        settings = VllmSettings(**spec.vllm)
        cpus = float(ray.cluster_resources().get("CPU", 0)) if cluster_cpus is None else cluster_cpus
        # Two CPU stages for video (chat template, multimodal parsing), each up to cpu_stage_max_actors.
        stage_actors = 2 * settings.cpu_stage_max_actors
        now = vllm_decode_workers(spec.cpu_concurrency, cpus, settings.concurrency, stage_actors)
        return decode_width(now, spec.cpu_to_accelerator, settings.concurrency)
    return cpu_task_slots(spec.cpu_concurrency, spec.vlm_concurrency)


def decoded_segments(rows: list[dict], spec: JobSpec):
    """The job's CPU stage as a Ray Dataset of segment rows, in blocks of at most ``SEGMENT_BLOCK_BYTES``."""
    import ray.data

    context = ray.data.DataContext.get_current()
    default = context.target_max_block_size
    context.target_max_block_size = SEGMENT_BLOCK_BYTES  # a Dataset keeps the context it was created under
    try:
        # One video per block (decode spreads wide), made here: a repartition would be a stage of its own.
        ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    finally:
        context.target_max_block_size = default
    return ds.flat_map(
        decode_and_sample,
        fn_kwargs={"sampling": spec.sampling},
        compute=ray.data.TaskPoolStrategy(size=decode_slots(spec)),
        num_cpus=1,
        max_retries=DECODE_TASK_RETRIES,
        retry_exceptions=False,
        **({"resources": spec.cpu_resources} if spec.cpu_resources else {}),
    )


def caption_rows(rows: list[dict], spec: JobSpec) -> Iterator[dict]:
    """Run the streaming job over ``rows`` (video_id, batch_key, uri, duration_s, rotation).

    Yields one result dict per segment as the VLM stage produces it (a video the CPU stage could not
    decode: one error row). A worker lost mid-job may make Ray run a task again, so a segment can come
    back twice: consumers keep one row per (video_id, segment)."""
    if not rows:
        return
    import ray.data

    ds = decoded_segments(rows, spec)
    served_app = None
    match spec.transport:
        case Transport.ENDPOINT:  # a server, or the caption model served on its route (the next batch reuses it)
            from video_assets.core.captioning.endpoint_engine import build_endpoint_processor_for_job

            if spec.served:  # the first replica is up (the model loaded) before any request is sent
                served_app = serving.deploy(spec)
                spec = replace(spec, endpoint=serving.endpoint(spec))
            ds = build_endpoint_processor_for_job(ds, spec)
        case Transport.VLLM:
            from video_assets.core.captioning.vllm_engine import build_vllm_processor_for_job
            from video_assets.core.inference.model_cache import place_on_every_node

            # vLLM and Ray's CPU stages open the model by path on whichever node Ray puts them: the step's folder
            # on every node, or a node cache each stage fills on its own node as it starts (later nodes too).
            placed = place_on_every_node(spec.engine.model)
            ds = build_vllm_processor_for_job(
                ds,
                replace(spec, vllm={**spec.vllm, "model_source": placed.path}),
                fetch=spec.engine.model if placed.per_node else None,
            )
        case Transport.TRANSFORMERS:
            ds = ds.map_batches(
                CaptionStage,
                fn_constructor_kwargs={"engine": spec.engine, "prompt": spec.prompt},
                batch_size=spec.engine.batch_size,
                compute=ray.data.ActorPoolStrategy(size=spec.vlm_concurrency),
                num_gpus=spec.vlm_num_gpus or None,
                num_cpus=1,
                **engine_stage_options(),
                **({"resources": spec.vlm_resources} if spec.vlm_resources else {}),
            )
    engine_node, asked = None, False
    for row in all_engines_first(tolerate_failed_batches(ds), spec.vlm_concurrency).iter_rows():
        out = {k: row.get(k) for k in RESULT_COLUMNS}
        if (spec.transport is Transport.VLLM or served_app) and out["status"] == CAPTION_OK:
            # Ray's vLLM stage and a served route do not say where they ran: the engine actors' (replicas') node,
            # when there is one. Asked once, at the first answer (the engines are up by then), not once a row.
            if not asked:
                engine_node = (
                    replica_node(served_app, serving.deployment(spec, served_app)) if served_app else vllm_engine_node()
                )
                asked = True
            out["engine_node"] = engine_node
        if served_app:  # what the job ran on, for its materialisation (``serving.engine_service``)
            out["served_app"] = served_app
        yield out


def _actors_node(actors, is_engine) -> str | None:
    nodes = {a["Address"]["NodeID"] for a in actors if is_engine(a)}
    return nodes.pop() if len(nodes) == 1 else None


def gcs_actors(job_id=None) -> list[dict]:
    """The GCS's actor table (one job's actors, or all): the only place that knows the node of an actor this
    code did not create (Ray Data LLM's vLLM stage, a Ray Serve LLM replica) without Ray's dashboard. Ray's
    public state API (``ray.util.state.list_actors``) asks the dashboard, which a Ray started here runs only
    with RAY_DASHBOARD=1, and neither actor says where it runs; hence Ray's private ``ray._private.state``
    (docs/reliability.md, "Private Ray/Dagster APIs still used")."""
    from ray._private import state

    return list(state.actors(job_id=job_id).values())


def vllm_engine_node() -> str | None:
    """The Ray node of this job's vLLM engine actors when they all run on one node, else None (``gcs_actors``);
    never fails the job."""
    try:
        actors = gcs_actors(job_id=ray.get_runtime_context().job_id)
        return _actors_node(actors, lambda a: "vLLMEngineStageUDF" in a["ActorClassName"])
    except Exception:
        return None


def replica_node(app: str, deployment: str) -> str | None:
    """The Ray node of the live replicas of Serve application ``app``'s ``deployment`` (its engine) when they all
    run on one node, else None (the replicas belong to Serve's job, not this one: ``gcs_actors`` of every job);
    never fails the job."""
    try:
        replica = f"ServeReplica:{app}:{deployment}"
        return _actors_node(gcs_actors(), lambda a: a["ActorClassName"].startswith(replica) and a["State"] == "ALIVE")
    except Exception:
        return None
