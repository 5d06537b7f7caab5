"""The captioning Ray Data job: a wide CPU stage (decode + sample) feeding a narrow VLM stage.

    rows ─► repartition ─► flat_map(decode_and_sample, 1-CPU tasks) ─► map_batches(CaptionStage, actor pool)
                                 │ failures
                                 └──► ErrorSink actor (never reach the VLM; written as status=error rows)

Kept free of Dagster so the stages can be driven and tested with plain Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray

from video_assets.core.inference.model_cache import ModelFiles
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


@ray.remote(num_cpus=0)
class ErrorSink:
    """Collects the rows the CPU stage could not turn into frames."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def all(self) -> list[dict]:
        return self.rows


def decode_and_sample(row: dict, sampling: SamplingConfig, sink) -> list[dict]:
    """CPU stage: one video in, one row per segment out (frames included); failures go to ``sink``."""
    started = time.perf_counter()
    try:
        sampled = sample_video(row["uri"], sampling, row.get("duration_s"), row.get("rotation"))
    except Exception as exc:  # one bad video becomes an error row, never a failed job
        sink.add.remote(
            {
                **_ids(row),
                "segment": 0,
                "error": f"{exc.__class__.__name__}: {exc}",
                "decode_s": time.perf_counter() - started,
            }
        )
        return []
    decode_s = (time.perf_counter() - started) / max(1, len(sampled.segments))
    return [
        {
            **_ids(row),
            "segment": seg.index,
            "segment_start_s": float(seg.start_s),
            "segment_end_s": float(seg.end_s),
            "frame_timestamps": [float(t) for t in seg.timestamps],
            "frames": seg.frames,
            "decode_s": decode_s,
            "decode_node": _node_id(),
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


class CaptionStage:
    """One engine per actor, loaded once; each call captions a batch of segments."""

    def __init__(self, engine: EngineSpec, prompt: str):
        self.engine = build_engine(engine)
        self.prompt = prompt
        self.max_new_tokens = engine.max_new_tokens
        self.node = _node_id()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        from video_assets.core.captioning.requests import CaptionRequest

        n = len(batch["video_id"])
        requests = [
            CaptionRequest(
                request_id=f"{batch['video_id'][i]}:{batch['segment'][i]}",
                frames=np.asarray(batch["frames"][i], dtype=np.uint8),
                timestamps=list(batch["frame_timestamps"][i]),
                prompt=self.prompt,
                max_new_tokens=self.max_new_tokens,
            )
            for i in range(n)
        ]
        started = time.perf_counter()
        responses = {r.request_id: r for r in self.engine.generate(requests)}
        engine_share = (time.perf_counter() - started) / max(1, n)  # sums to the engine's busy time
        out: dict[str, list] = {k: [] for k in RESULT_COLUMNS}
        for i, req in enumerate(requests):
            resp = responses.get(req.request_id)
            for k in (
                "video_id",
                "batch_key",
                "uri",
                "segment",
                "segment_start_s",
                "segment_end_s",
                "decode_s",
                "decode_node",
            ):
                out[k].append(batch[k][i])
            out["engine_node"].append(self.node)
            out["frame_timestamps"].append(list(req.timestamps))
            out["prose"].append(resp.text if resp else "")
            out["input_tokens"].append(resp.input_tokens if resp else 0)
            out["output_tokens"].append(resp.output_tokens if resp else 0)
            out["latency_s"].append(resp.latency_s if resp else 0.0)
            error = "engine returned no response" if resp is None else resp.error
            out["engine_s"].append(engine_share)
            out["status"].append(CAPTION_ERROR if error else CAPTION_OK)
            out["error"].append(error)
        return out


RESULT_COLUMNS = [
    "video_id",
    "batch_key",
    "uri",
    "segment",
    "segment_start_s",
    "segment_end_s",
    "frame_timestamps",
    "decode_s",
    "engine_s",
    "prose",
    "input_tokens",
    "output_tokens",
    "latency_s",
    "status",
    "error",
    "decode_node",  # Ray node ids of the two stages: not table columns, reported in the metadata
    "engine_node",
]


def caption_rows(rows: list[dict], spec: JobSpec) -> Iterator[dict]:
    """Run the streaming job over ``rows`` (video_id, batch_key, uri, duration_s, rotation).

    Yields one result dict per segment as the VLM stage produces it, then one per failed video.
    """
    if not rows:
        return
    import ray.data

    sink = ErrorSink.remote()
    ds = ray.data.from_items(rows).repartition(len(rows))  # one video per block: decode spreads wide
    ds = ds.flat_map(
        decode_and_sample,
        fn_kwargs={"sampling": spec.sampling, "sink": sink},
        compute=ray.data.TaskPoolStrategy(size=spec.cpu_concurrency),
        num_cpus=1,
        **({"resources": spec.cpu_resources} if spec.cpu_resources else {}),
    )
    if spec.engine.name == "vllm":
        from video_assets.core.captioning.vllm_engine import build_vllm_processor_for_job
        from video_assets.core.inference.model_cache import place_on_every_node

        # vLLM and Ray's CPU stages open the model by path on whichever node Ray puts them.
        model = place_on_every_node(spec.engine.model).path
        ds = build_vllm_processor_for_job(ds, replace(spec, vllm={**spec.vllm, "model_source": model}))
    else:
        ds = ds.map_batches(
            CaptionStage,
            fn_constructor_kwargs={"engine": spec.engine, "prompt": spec.prompt},
            batch_size=spec.engine.batch_size,
            compute=ray.data.ActorPoolStrategy(size=spec.vlm_concurrency),
            num_gpus=spec.vlm_num_gpus or None,
            num_cpus=1,
            **({"resources": spec.vlm_resources} if spec.vlm_resources else {}),
        )
    for row in ds.iter_rows():
        yield {k: row.get(k) for k in RESULT_COLUMNS}
    for err in ray.get(sink.all.remote()):
        yield {
            **{k: None for k in RESULT_COLUMNS},
            **err,
            "frame_timestamps": [],
            "prose": "",
            "input_tokens": 0,
            "output_tokens": 0,
            "latency_s": 0.0,
            "engine_s": 0.0,
            "status": CAPTION_ERROR,
        }
    ray.kill(sink)
