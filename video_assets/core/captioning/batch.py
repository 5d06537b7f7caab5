"""What the captions job (``job``) and the served caption replicas (``core.serving.captioner``) share: the
job's spec, and one batch of segments captioned by a loaded engine. Its own module so the two share it
without importing each other."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import ray

from video_assets.core.captioning.rows import CARRIED_COLUMNS, decode_error
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.media import frames
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK


@dataclass(frozen=True)
class EngineSpec:
    """Everything an actor needs to build its engine; plain data so it ships to remote workers."""

    name: str  # transformers | vllm | endpoint
    # The step's download, used where it exists (same node or a shared filesystem); elsewhere the
    # registered artifact, downloaded into the node's cache once per node.
    model: ModelFiles
    device: str = "auto"
    batch_size: int = 4
    max_new_tokens: int = 128


SERVED_ENGINES = ("transformers", "vllm")  # what this product serves itself on a Ray that outlives the steps


class Transport(StrEnum):
    """How a model stage reaches its model: the one engine choice, made once (``defs.engines.job_spec``, ``auto``
    asked of the cluster) and read by every stage that runs the model; asset bodies never branch on it."""

    TRANSFORMERS = "in-job transformers"  # engines loaded in the job's actors: CPU, tests, the laptop demo
    VLLM = "in-job vllm"  # Ray Data LLM's vLLM processor in the job: big GPU backfills
    ENDPOINT = "endpoint"  # an OpenAI-compatible route: a server, a hosted API, or this product's served model


@dataclass(frozen=True)
class JobSpec:
    sampling: SamplingConfig
    engine: EngineSpec
    prompt: str
    cpu_concurrency: int = 2
    vlm_concurrency: int = 1
    vlm_num_gpus: float = 0.0
    vllm: dict[str, Any] = field(default_factory=dict)  # vLLM settings when engine.name == "vllm"
    # ``core.inference.endpoint.Endpoint`` fields when engine.name == "endpoint" (the key: never shown)
    endpoint: dict[str, Any] = field(default_factory=dict, repr=False)
    # Ray custom resources each decode task / VLM actor requires (pin a stage to some nodes).
    cpu_resources: dict[str, float] = field(default_factory=dict)
    vlm_resources: dict[str, float] = field(default_factory=dict)
    # > 0: the engine is a Ray Serve application that outlives the job (a Ray cluster that outlives the
    # step, ``core.serving.captioner``), scaled to zero after this many idle seconds; 0: a pool of actors per job.
    warm_idle_s: float = 0.0
    # Where the served caption application's route is (``core.serving.captioner``): Serve's HTTP proxy "host" and
    # "port" (when a step starts Serve), the "url" steps send to and the instance's serve "api_key" (never shown).
    serve: dict[str, Any] = field(default_factory=dict, repr=False)
    # Seconds a model server (an endpoint, a served replica) has to answer one request (VLM_REQUEST_TIMEOUT_S);
    # then that request is an error row naming the timeout. In-job engines answer in the job's own actors.
    request_timeout_s: float = 120.0
    # vLLM: decode CPU seconds per engine second measured on earlier batches (the throughput model's ratio),
    # which sizes the decode stage to the engines (``throughput.decode_width``); None before any.
    cpu_to_accelerator: float | None = None

    @property
    def served(self) -> bool:
        """The model is this product's own served application (``core.serving``), on a Ray that outlives the steps."""
        return self.warm_idle_s > 0 and self.engine.name in SERVED_ENGINES

    @property
    def transport(self) -> Transport:
        if self.engine.name == "endpoint" or self.served:
            return Transport.ENDPOINT
        return Transport.VLLM if self.engine.name == "vllm" else Transport.TRANSFORMERS


# decode_node and engine_node (the Ray nodes of the two stages) and preview (a JPEG strip of segment
# 0's frames, b"" on the others) go to the metadata, not the table; frames (JPEGs) to sampled_frames.
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


def node_id() -> str:
    """The Ray node this code runs on (reported per stage: where the work actually ran)."""
    return ray.get_runtime_context().get_node_id()


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
    errors = {i: e for i in range(n) if (e := decode_error(batch["decode_error"][i]))}  # error rows: no engine
    requests = {}
    for i in range(n):
        if i in errors:
            continue
        try:
            pixels = frames.decode(batch["frames"][i])  # JPEG from the CPU stage (core.media.frames)
        except ValueError as exc:
            errors[i] = f"frames: {exc}"
            continue
        requests[i] = CaptionRequest(
            request_id=f"{batch['video_id'][i]}:{batch['segment'][i]}",
            frames=pixels,
            timestamps=list(batch["frame_timestamps"][i]),
            prompt=prompt,
            max_new_tokens=max_new_tokens,
        )
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
            error = errors[i]
        else:
            error = "engine returned no response" if resp is None else resp.error
        out["engine_s"].append(engine_share if req else 0.0)
        out["status"].append(CAPTION_ERROR if error else CAPTION_OK)
        out["error"].append(error)
    return out
