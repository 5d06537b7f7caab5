"""The captioning Ray Data job: a wide CPU stage (decode + sample) feeding a narrow VLM stage.

    rows ─► repartition ─► flat_map(decode_and_sample, 1-CPU tasks) ─► map_batches(CaptionStage, actor pool)

On warm engines (detached actors that outlive the job, see ``WarmEngine``) the job's driver hands the
decoded batches to them itself (``_caption_on_warm_engines``) instead of running a VLM stage.

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

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray

from video_assets.core.captioning.rows import CARRIED_COLUMNS, decode_error
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.retries import engine_stage_options, tolerate_failed_batches
from video_assets.core.inference.service_runner import NAMESPACE, IdleExpiry, code_version
from video_assets.core.media.sampling import SamplingConfig, sample_video
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK


@dataclass(frozen=True)
class EngineSpec:
    """Everything an actor needs to build its engine; plain data so it ships to remote workers."""

    name: str  # transformers | vllm
    # The step's download, used where it exists (same node or a shared filesystem); elsewhere the
    # registered artifact, downloaded into the node's cache once per node.
    model: ModelFiles
    device: str = "auto"
    batch_size: int = 4
    max_new_tokens: int = 128


@dataclass(frozen=True)
class JobSpec:
    sampling: SamplingConfig
    engine: EngineSpec
    prompt: str
    cpu_concurrency: int = 2
    vlm_concurrency: int = 1
    vlm_num_gpus: float = 0.0
    vllm: dict[str, Any] = field(default_factory=dict)  # vLLM settings when engine.name == "vllm"
    # Ray custom resources each decode task / VLM actor requires (pin a stage to some nodes).
    cpu_resources: dict[str, float] = field(default_factory=dict)
    vlm_resources: dict[str, float] = field(default_factory=dict)
    # > 0: engines are detached actors that outlive the job and expire after this many idle seconds
    # (a Ray cluster that outlives the step); 0: a pool of actors per job.
    warm_idle_s: float = 0.0


# Batches queued at each warm engine, so that the next is there when one finishes.
WARM_IN_FLIGHT = 2
# Times a batch is sent again to a warm engine that died under it (started again in between).
WARM_RESENDS = 2

DECODE_TASK_RETRIES = 3  # worker deaths only (OOM kill, lost node): decoding is idempotent
NO_FRAMES = np.zeros((0, 1, 1, 3), dtype=np.uint8)  # an error row's frames: same column type as real ones


def _preview(frames, timestamps) -> bytes:
    """A small JPEG strip of a segment's frames, so the asset can show what the model saw without
    decoding the video again; never fails the row."""
    from video_assets.core.charts import thumbnail_strip

    try:
        return thumbnail_strip(frames, timestamps)
    except Exception:
        return b""


def decode_and_sample(row: dict, sampling: SamplingConfig) -> list[dict]:
    """CPU stage: one video in, one row per segment out (frames included, and a preview strip on the
    first); a video that cannot be decoded is one row with ``decode_error`` set."""
    started = time.perf_counter()
    try:
        sampled = sample_video(row["uri"], sampling, row.get("duration_s"), row.get("rotation"))
    except Exception as exc:  # one bad video becomes an error row, never a failed job
        return [
            {
                **_ids(row),
                "segment": 0,
                "segments": 1,
                "segment_start_s": 0.0,
                "segment_end_s": 0.0,
                "frame_timestamps": [],
                "frames": NO_FRAMES,
                "decode_s": time.perf_counter() - started,
                "decode_node": _node_id(),
                "decode_error": f"{exc.__class__.__name__}: {exc}",
                "preview": b"",
            }
        ]
    decode_s = (time.perf_counter() - started) / max(1, len(sampled.segments))
    return [
        {
            **_ids(row),
            "segment": seg.index,
            "segments": len(sampled.segments),
            "segment_start_s": float(seg.start_s),
            "segment_end_s": float(seg.end_s),
            "frame_timestamps": [float(t) for t in seg.timestamps],
            "frames": seg.frames,
            "decode_s": decode_s,
            "decode_node": _node_id(),
            "decode_error": "",  # not None: a column of Nones reaches the VLM stage as float NaN
            "preview": _preview(seg.frames, seg.timestamps) if seg.index == 0 else b"",
        }
        for seg in sampled.segments
    ]


def _node_id() -> str:
    """The Ray node this code runs on (reported per stage: where the work actually ran)."""
    return ray.get_runtime_context().get_node_id()


def _ids(row: dict) -> dict:
    return {"video_id": row["video_id"], "batch_key": row["batch_key"], "uri": row["uri"]}


def build_engine(spec: EngineSpec):
    if spec.name == "transformers":
        from video_assets.core.captioning.transformers_engine import TransformersEngine

        return TransformersEngine(
            spec.model.here(), device=spec.device, batch_size=spec.batch_size, max_new_tokens=spec.max_new_tokens
        )
    raise ValueError(f"engine {spec.name!r} does not run inside a CaptionStage actor")


def caption_batch(engine, node: str, batch: dict[str, np.ndarray], prompt: str, max_new_tokens: int) -> dict:
    """One Ray Data batch of segment rows captioned by ``engine``: RESULT_COLUMNS, one row per input row
    (the CPU stage's error rows pass through without the engine)."""
    from video_assets.core.captioning.requests import CaptionRequest

    n = len(batch["video_id"])
    decoded = [i for i in range(n) if not decode_error(batch["decode_error"][i])]  # the rest: error rows
    requests = {
        i: CaptionRequest(
            request_id=f"{batch['video_id'][i]}:{batch['segment'][i]}",
            frames=np.asarray(batch["frames"][i], dtype=np.uint8),
            timestamps=list(batch["frame_timestamps"][i]),
            prompt=prompt,
            max_new_tokens=max_new_tokens,
        )
        for i in decoded
    }
    started = time.perf_counter()
    responses = {r.request_id: r for r in engine.generate(list(requests.values()))} if requests else {}
    engine_share = (time.perf_counter() - started) / max(1, len(requests))  # sums to the engine's busy time
    out: dict[str, list] = {k: [] for k in RESULT_COLUMNS}
    for i in range(n):
        req = requests.get(i)
        resp = responses.get(req.request_id) if req else None
        for k in CARRIED_COLUMNS:
            out[k].append(batch[k][i])
        out["engine_node"].append(node if req else None)
        out["frame_timestamps"].append([float(t) for t in batch["frame_timestamps"][i]])
        out["prose"].append(resp.text if resp else "")
        out["input_tokens"].append(resp.input_tokens if resp else 0)
        out["output_tokens"].append(resp.output_tokens if resp else 0)
        out["latency_s"].append(resp.latency_s if resp else 0.0)
        if req is None:
            error = decode_error(batch["decode_error"][i])
        else:
            error = "engine returned no response" if resp is None else resp.error
        out["engine_s"].append(engine_share if req else 0.0)
        out["status"].append(CAPTION_ERROR if error else CAPTION_OK)
        out["error"].append(error)
    return out


class CaptionStage:
    """One engine per actor of the job's pool, loaded once per job; each call captions a batch."""

    def __init__(self, engine: EngineSpec, prompt: str):
        self.engine = build_engine(engine)
        self.prompt = prompt
        self.max_new_tokens = engine.max_new_tokens
        self.node = _node_id()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        return caption_batch(self.engine, self.node, batch, self.prompt, self.max_new_tokens)


WARM_NAMESPACE = NAMESPACE  # Ray namespace of the engines that outlive a job


class WarmEngine(IdleExpiry):
    """An engine that outlives the job (a detached Ray actor): later batches on the same long-lived Ray
    cluster reuse it instead of spawning an actor and loading the model again. It exits after
    ``idle_s`` without work, giving back its memory (and GPU)."""

    def __init__(self, engine: EngineSpec, idle_s: float):
        self.engine = build_engine(engine)
        self.max_new_tokens = engine.max_new_tokens
        self.node = _node_id()
        self._structurer = None  # built on the first structuring request, on the same loaded model
        self.structured = 0  # structuring requests served
        self._start_expiry(idle_s)

    def info(self) -> dict:
        import os

        return {
            "pid": os.getpid(),
            "node": self.node,
            "idle_s": time.monotonic() - self.last_used,
            "busy": self.busy,
            "structured": self.structured,
        }

    def caption(self, batch: dict[str, np.ndarray], prompt: str) -> dict[str, list]:
        self._enter()
        try:
            return caption_batch(self.engine, self.node, batch, prompt, self.max_new_tokens)
        finally:
            self._leave()

    def structure(self, requests: list, batch_size: int) -> list:
        """Structuring requests (``core.structuring.policy``) on this engine's loaded model: the
        structurer 'captioner' on the long-lived Ray shares it instead of loading a second copy."""
        from video_assets.core.structuring.engines import TransformersStructurer

        self._enter()
        try:
            if self._structurer is None:
                self._structurer = TransformersStructurer(loaded=self.engine.loaded)
            self._structurer.batch_size = max(1, int(batch_size))
            self.structured += len(requests)
            return self._structurer.generate(requests)
        finally:
            self._leave()


class WarmStructurer:
    """A structuring engine (``generate``) that runs on the warm caption engine of ``spec``, started
    if it is not up; for the structurer 'captioner' when steps join a Ray that outlives them."""

    name = "transformers (warm caption engine)"
    speculative_retry = False  # a loaded model: a retry costs only its own (short) generation

    def __init__(self, spec: JobSpec, batch_size: int):
        self.spec, self.batch_size = spec, batch_size
        self.engine_name = ensure_warm_engines(spec)[0]

    def generate(self, requests: list) -> list:
        try:
            engine = ray.get_actor(self.engine_name, namespace=WARM_NAMESPACE)
        except ValueError:  # stopped meanwhile (expired, or evicted for another model)
            ensure_warm_engines(self.spec)
            engine = ray.get_actor(self.engine_name, namespace=WARM_NAMESPACE)
        return ray.get(engine.structure.remote(requests, self.batch_size))


def warm_engine_names(spec: JobSpec) -> list[str]:
    """The names of the warm engines a job uses: one per ``vlm_concurrency``, keyed by everything that
    decides what an engine computes (model, device, limits, and this code's own version), so a new
    model version or a code change gets new engines and the old ones expire."""
    import hashlib

    h = hashlib.sha256(repr((spec.engine, spec.vlm_num_gpus, sorted(spec.vlm_resources.items()))).encode())
    h.update(code_version().encode())
    return [f"caption-engine-{h.hexdigest()[:12]}-{i}" for i in range(spec.vlm_concurrency)]


def ensure_warm_engines(spec: JobSpec) -> list[str]:
    """Start the job's warm engines unless they are already up; returns their names. Idle engines of
    another model, settings or code version are stopped first when the new ones would not leave a
    CPU (or the GPUs they need) free: otherwise they would hold it until they expire and the job's
    decode tasks could never start."""
    names = warm_engine_names(spec)
    missing = [n for n in names if not _engine_alive(n)]
    if missing:
        _evict_idle_engines(
            keep=names,
            cpus=len(missing),
            gpus=len(missing) * spec.vlm_num_gpus,
            custom={k: v * len(missing) for k, v in spec.vlm_resources.items()},
        )
    actor = ray.remote(WarmEngine)
    for name in names:
        actor.options(
            name=name,
            namespace=WARM_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=1,
            num_gpus=spec.vlm_num_gpus or None,
            **engine_stage_options(),
            **({"resources": spec.vlm_resources} if spec.vlm_resources else {}),
        ).remote(spec.engine, spec.warm_idle_s)
    return names


def _engine_alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=WARM_NAMESPACE)
        return True
    except ValueError:
        return False


def make_room(cpus: float, gpus: float = 0.0) -> list[str]:
    """Stop idle warm caption engines that would leave another stage's job (an archive encoder: ``cpus``
    actors and their ``gpus``, plus a decode task) waiting for their idle expiry; returns those stopped.
    Measured before: every archive step after a captions step on the long-lived local Ray waited about
    300 s (the engines' idle delay) on 2 CPUs."""
    if not ray.is_initialized():
        return []
    return _evict_idle_engines(keep=[], cpus=cpus, gpus=gpus)


def _evict_idle_engines(keep: list[str], cpus: float, gpus: float, custom: dict[str, float] | None = None) -> list[str]:
    """Stop idle warm engines not in ``keep`` while the cluster lacks ``cpus`` + 1 free CPUs (one for
    a decode task), ``gpus`` free GPUs or the ``custom`` resources the new engines are pinned by (an idle
    engine holding the one node's pin would otherwise make them wait for its expiry); returns the names
    stopped. A busy engine is never stopped."""
    stopped: list[str] = []

    def short() -> bool:
        free = ray.available_resources()
        lacking = any(free.get(name, 0.0) < amount for name, amount in (custom or {}).items())
        return lacking or free.get("CPU", 0.0) < cpus + 1 or free.get("GPU", 0.0) < gpus

    if not short():
        return stopped
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] != WARM_NAMESPACE or not name.startswith("caption-engine-") or name in keep:
            continue
        try:
            handle = ray.get_actor(name, namespace=WARM_NAMESPACE)
            if ray.get(handle.info.remote(), timeout=10)["busy"]:
                continue
            ray.kill(handle, no_restart=True)
            stopped.append(name)
        except Exception:  # gone meanwhile, or not answering: leave it to its own expiry
            continue
        deadline = time.monotonic() + 10  # its resources come back when the process is gone
        while short() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not short():
            break
    return stopped


def _warm_engine(name: str, spec: JobSpec):
    """The handle of warm engine ``name``; an engine stopped meanwhile (evicted for another model, or
    expired) is started again."""
    try:
        return ray.get_actor(name, namespace=WARM_NAMESPACE)
    except ValueError:
        ensure_warm_engines(spec)
        return ray.get_actor(name, namespace=WARM_NAMESPACE)


def _plain(value):
    """numpy scalars (a Ray Data batch's cells) as Python values, as ``iter_rows`` gives them."""
    return value.item() if isinstance(value, np.generic) else value


def _caption_on_warm_engines(ds, spec: JobSpec) -> Iterator[dict]:
    """The VLM stage on warm engines, driven from the job's driver: Ray Data runs the decode stage, and
    each batch of decoded segments goes to an engine (round robin), ``WARM_IN_FLIGHT`` queued at each.
    Not a Ray Data stage of light tasks that call the engine: such a task took the worker the next
    decode task was waiting for, and the two stages took turns (measured on 2 CPUs: four decodes, then
    the engine, then four decodes; a 32-clip batch took 11-12 s, 6 s driven from here). An engine
    that dies under a batch (killed, evicted, out of memory) is started again and the batch sent
    again, up to ``WARM_RESENDS`` times; then the job fails, losing nothing silently."""
    names = ensure_warm_engines(spec)
    pending: deque = deque()

    def finish(name, batch, ref) -> Iterator[dict]:
        for resend in range(WARM_RESENDS + 1):
            try:
                out = ray.get(ref)
                break
            except ray.exceptions.RayActorError:
                if resend == WARM_RESENDS:
                    raise
                ref = _warm_engine(name, spec).caption.remote(batch, spec.prompt)
        for i in range(len(out["video_id"])):
            yield {k: _plain(out[k][i]) for k in RESULT_COLUMNS}

    batches = ds.iter_batches(batch_size=spec.engine.batch_size, batch_format="numpy")
    for i, batch in enumerate(batches):
        name = names[i % len(names)]
        pending.append((name, batch, _warm_engine(name, spec).caption.remote(batch, spec.prompt)))
        while len(pending) >= WARM_IN_FLIGHT * len(names):
            yield from finish(*pending.popleft())
    while pending:
        yield from finish(*pending.popleft())


# decode_node and engine_node (the Ray nodes of the two stages) and preview (a JPEG strip of segment
# 0's frames, b"" on the others) go to the metadata, not the table.
RESULT_COLUMNS = [
    *CARRIED_COLUMNS,
    "frame_timestamps",
    "engine_s",
    "prose",
    "input_tokens",
    "output_tokens",
    "latency_s",
    "status",
    "error",
    "engine_node",
]


def cpu_task_slots(concurrency: int, engines: int) -> int:
    """CPU tasks (1 CPU each) a job asks Ray Data for: ``concurrency``, but no more than the CPUs of
    the connected cluster that ``engines`` (1 CPU each) leave free. Asking for more than can run makes
    Ray Data queue tasks it counts as running, and the stream stalls (measured on 2 CPUs: a 20-clip
    batch 1.5x slower)."""
    from video_assets.core.throughput import decode_workers

    cpus = float(ray.cluster_resources().get("CPU", 0))
    return decode_workers(concurrency, cpus, engines) if cpus else concurrency


def decode_slots(spec: JobSpec) -> int:
    """The captioning job's decode tasks: ``cpu_task_slots`` beside transformers actors; beside vLLM, the
    cluster's CPUs its engines and Ray's CPU stages leave (``vllm_decode_workers``)."""
    if spec.vlm_resources or spec.cpu_resources:
        return spec.cpu_concurrency  # pinned stages: the cluster total says nothing
    if spec.engine.name == "vllm":
        from video_assets.core.inference.vllm import VllmSettings
        from video_assets.core.throughput import vllm_decode_workers

        settings = VllmSettings(**spec.vllm)
        cpus = float(ray.cluster_resources().get("CPU", 0))
        # Two CPU stages for video (chat template, multimodal parsing), each up to cpu_stage_max_actors.
        stage_actors = 2 * settings.cpu_stage_max_actors
        return vllm_decode_workers(spec.cpu_concurrency, cpus, settings.concurrency, stage_actors)
    return cpu_task_slots(spec.cpu_concurrency, spec.vlm_concurrency)


def caption_rows(rows: list[dict], spec: JobSpec) -> Iterator[dict]:
    """Run the streaming job over ``rows`` (video_id, batch_key, uri, duration_s, rotation).

    Yields one result dict per segment as the VLM stage produces it (a video the CPU stage could not
    decode: one error row). A worker lost mid-job may make Ray run a task again, so a segment can come
    back twice: consumers keep one row per (video_id, segment)."""
    if not rows:
        return
    import ray.data

    ds = ray.data.from_items(rows).repartition(len(rows))  # one video per block: decode spreads wide
    ds = ds.flat_map(
        decode_and_sample,
        fn_kwargs={"sampling": spec.sampling},
        compute=ray.data.TaskPoolStrategy(size=decode_slots(spec)),
        num_cpus=1,
        max_retries=DECODE_TASK_RETRIES,
        retry_exceptions=False,
        **({"resources": spec.cpu_resources} if spec.cpu_resources else {}),
    )
    if spec.engine.name == "vllm":
        from video_assets.core.captioning.vllm_engine import build_vllm_processor_for_job
        from video_assets.core.inference.model_cache import place_on_every_node

        # vLLM and Ray's CPU stages open the model by path on whichever node Ray puts them.
        model = place_on_every_node(spec.engine.model).path
        ds = build_vllm_processor_for_job(ds, replace(spec, vllm={**spec.vllm, "model_source": model}))
    elif spec.warm_idle_s > 0:
        yield from _caption_on_warm_engines(ds, spec)
        return
    else:
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
    for row in tolerate_failed_batches(ds).iter_rows():
        out = {k: row.get(k) for k in RESULT_COLUMNS}
        if spec.engine.name == "vllm" and out["status"] == CAPTION_OK:
            # Ray's vLLM stage does not say where it ran: its engine actors' node, when there is one. Asked
            # once, at the first answer (the engines are up by then), not once a row.
            if not asked:
                engine_node, asked = vllm_engine_node(), True
            out["engine_node"] = engine_node
        yield out


def vllm_engine_node() -> str | None:
    """The Ray node of this job's vLLM engine actors when they all run on one node, else None. Read from
    the GCS's actor table (``ray._private.state``, the one place that knows an unnamed actor's node without
    the dashboard); never fails the job."""
    try:
        from ray._private import state

        actors = state.actors(job_id=ray.get_runtime_context().job_id).values()
        nodes = {a["Address"]["NodeID"] for a in actors if "vLLMEngineStageUDF" in a["ActorClassName"]}
        return nodes.pop() if len(nodes) == 1 else None
    except Exception:
        return None
