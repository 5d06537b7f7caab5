"""vLLM through Ray Data LLM, for both model stages: one settings model, one processor config
builder, one way to write sampling parameters and to read an output row.

Importable without vLLM: ``ray.data.llm`` is imported only when a processor config is built, and
nothing here touches vLLM until the processor's stages start on GPU workers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from video_assets.core.validation import reasons

ERROR_KEY = "__inference_error__"  # Ray Data LLM's per-row error column; rows carrying it skip all stages


class VllmSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt override is an error, not a silent default

    model_source: str
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per engine")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Share of each GPU's memory vLLM takes")
    max_num_seqs: int = Field(default=64, ge=1, description="Requests an engine runs at once")
    max_model_len: int = Field(default=32768, ge=256, description="Context length (prompt, frames and output)")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=lambda: {"video": 1, "image": 0}, description="Multimodal items reserved per prompt"
    )
    # vLLM 0.29's video loader keeps at most this many frames of a video (its default 32) and drops the
    # rest silently: requests with more are refused before they reach it (``check_frames``).
    max_video_frames: int = Field(
        default=32, ge=1, description="Frames vLLM's video loader keeps per video; a plan with more is refused"
    )
    concurrency: int = Field(
        default=1, ge=1, description="Engine replicas (each tensor_parallel_size GPUs); the resource's `concurrency`"
    )
    batch_size: int = Field(default=16, ge=1, description="Rows per Ray Data batch sent to an engine")
    # Ray's multimodal stage decodes a segment's JPEGs into arrays before the engine; by default an engine
    # takes 8 batches at once and Ray Data sends it 16 (with batch_size 64 about 1,000 segments, 10 GB of
    # frames at the default pixel budget). Captioning sizes max_concurrent_batches to this budget.
    frames_in_flight_mb: int = Field(
        default=4096,
        ge=1,
        description="Decoded frames an engine may have queued, in MB (captioning: sets how many batches it takes at once)",
    )
    # Ray's CPU stages (chat template, multimodal parsing, tokenize/detokenize) default to the engines'
    # concurrency, i.e. one actor each: too few to keep an engine fed with video requests.
    cpu_stage_max_actors: int = Field(
        default=4, ge=1, description="Each of Ray's CPU stages autoscales from 1 to this many actors"
    )
    max_new_tokens: int = Field(
        default=256, ge=1, description="Ceiling on max_tokens per request; the resource's `max_new_tokens`"
    )
    accelerator_type: str | None = Field(default=None, description='e.g. "H100"; None lets Ray place anywhere')
    dtype: str = Field(default="auto", description="Weights' dtype (auto: the checkpoint's)")
    should_continue_on_error: bool = Field(default=True, description="A failed row gets an error, not a failed job")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine args (override)")
    # Where the engine runs. None: Ray's default, one GPU per worker. vLLM's CPU build needs
    # {"bundles": [{"CPU": 1}]} (tests/test_vllm_cpu.py).
    placement_group_config: dict[str, Any] | None = Field(default=None, description="Ray placement group of an engine")
    log_engine_metrics: bool = Field(
        default=True, description="vLLM metrics through Ray's Prometheus endpoint (needs ray[serve] installed)"
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description='Environment of the processor\'s workers, e.g. {"VLLM_CPU_KVCACHE_SPACE": "1"}',
    )


# Each stage's engine settings where they differ from VllmSettings' defaults: a batch per engine call
# large enough to fill max_num_seqs, and a text model's shorter context.
CAPTION_VLLM: dict[str, Any] = {"batch_size": 64}
STRUCTURING_VLLM: dict[str, Any] = {"batch_size": 64, "max_model_len": 8192}


def vllm_settings(model_source: str, stage: dict[str, Any], user: dict[str, Any]) -> VllmSettings:
    """``VllmSettings`` of one stage: its defaults, then the user's ``vllm`` setting; a bad name or
    value is a ValueError naming it."""
    from pydantic import ValidationError

    try:
        return VllmSettings(**{**stage, **user, "model_source": model_source})
    except ValidationError as exc:
        problems = reasons(exc)
        raise ValueError(f"vllm: {problems}") from exc


def engine_kwargs(settings: VllmSettings, multimodal: bool = True) -> dict[str, Any]:
    return {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_num_seqs": settings.max_num_seqs,
        "max_model_len": settings.max_model_len,
        # A VLM used as a text model (structuring) reserves no image or video slots.
        "limit_mm_per_prompt": dict(settings.limit_mm_per_prompt) if multimodal else {"image": 0, "video": 0},
        "dtype": settings.dtype,
        # Free whitespace lets a weak model pad JSON to max_tokens; in vLLM 0.29 it is an engine setting.
        **(
            {} if multimodal else {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
        ),
        **settings.engine_kwargs,
    }


def concurrent_batches(settings: VllmSettings, segment_mb: float) -> int:
    """Batches an engine takes at once (Ray Data sends no more) so that ``batch_size`` segments of
    ``segment_mb`` decoded frames each stay within ``frames_in_flight_mb``: at least 1, at most Ray's 8."""
    per_batch = settings.batch_size * max(segment_mb, 1e-6)
    return max(1, min(8, int(settings.frames_in_flight_mb // per_batch)))


def processor_config(settings: VllmSettings, multimodal: bool = True, segment_mb: float | None = None):
    """The ``ray.data.llm.vLLMEngineProcessorConfig`` of a stage: video captioning (``multimodal``)
    or text-only structured outputs. ``segment_mb``: a segment's decoded frames at most (max_frames x the
    pixel budget x 3 bytes); the batches in flight per engine are bounded by ``frames_in_flight_mb``."""
    from ray.data.llm import vLLMEngineProcessorConfig

    kwargs = engine_kwargs(settings, multimodal)
    cpu_stage = {"enabled": True, "concurrency": (1, settings.cpu_stage_max_actors)}
    stages: dict[str, Any]
    if multimodal:
        stages = dict(
            # vLLM's own chat parser turns the OpenAI video_url part into frames + the model's placeholder.
            prepare_multimodal_stage={
                **cpu_stage,
                "model_config_kwargs": {
                    "limit_mm_per_prompt": kwargs["limit_mm_per_prompt"],
                    "max_model_len": kwargs["max_model_len"],
                },
                "chat_template_content_format": "string",
            },
            # Text prompt + multi_modal_data straight to vLLM: it tokenizes and detokenizes itself, the
            # best-trodden multimodal path (placeholders expand inside vLLM's processor).
            tokenize_stage=False,
            detokenize_stage=False,
        )
    else:
        stages = dict(tokenize_stage=dict(cpu_stage), detokenize_stage=dict(cpu_stage))
    return vLLMEngineProcessorConfig(
        model_source=settings.model_source,
        engine_kwargs=kwargs,
        # (n, n): every engine starts with the job. An int is a pool autoscaling from 1 in Ray Data LLM's vLLM
        # stage, whose other engines arrive after a small batch is done.
        concurrency=(settings.concurrency, settings.concurrency),
        batch_size=settings.batch_size,
        accelerator_type=settings.accelerator_type,
        should_continue_on_error=settings.should_continue_on_error,
        placement_group_config=settings.placement_group_config,
        log_engine_metrics=settings.log_engine_metrics,
        runtime_env={"env_vars": dict(settings.env_vars)} if settings.env_vars else None,
        chat_template_stage=dict(cpu_stage),
        **stages,
        **({} if segment_mb is None else _in_flight(concurrent_batches(settings, segment_mb))),
    )


def engine_env(settings: VllmSettings) -> dict[str, Any] | None:
    """The ``runtime_env`` of a served engine (``ray.serve.llm``): the calling job's variables (what the step
    forwards to its workers: stores, MLflow, the hub; credentials are never among them, ``EmbeddedRay``) with
    ``env_vars`` over them. Ray Serve LLM's ``LLMServer`` sets a replica's runtime_env to the caller's with
    this one's keys over it, so its ``env_vars`` would replace the forwarded ones, not extend them. (Actors
    inside the job need none of this: Ray merges their ``env_vars`` with the job's.)"""
    import ray

    inherited = (ray.get_runtime_context().runtime_env or {}).get("env_vars") if ray.is_initialized() else None
    env = {**(inherited or {}), **settings.env_vars}
    return {"env_vars": env} if env else None


def _in_flight(batches: int) -> dict[str, int]:
    # Ray Data would send each engine actor twice as many batches as it runs (queued in its mailbox).
    return {"max_concurrent_batches": batches, "max_tasks_in_flight_per_actor": batches}


ENGINE_STAGE = "vLLMEngineStage"


def fetch_model_on_nodes(processor, files):
    """The processor with each stage's actor fetching the registered model (``files``) on its own node as it
    starts: the engine all of it, the CPU stages its small files (``model_cache.fetch_in_stages``). For a
    placement whose path is a node cache (``Placement.per_node``): nodes that join later are covered too."""
    from video_assets.core.inference.model_cache import fetch_in_stages

    fetch_in_stages(processor.stages, files, (ENGINE_STAGE,))
    return processor


def bounded_engine_retries(processor, stage: str = ENGINE_STAGE):
    """The processor with its engine stage retrying a batch a bounded number of times. Ray's vLLM stage
    ``os._exit``s its actor on a fatal engine error (e.g. CUDA out of memory on one oversized prompt) and
    keeps Ray Data's unbounded retries, so a poison batch would be retried forever; ``vLLMEngineProcessorConfig``
    has no setting for it, hence the stage's own map_batches options."""
    from video_assets.core.inference.retries import engine_stage_options

    processor.get_stage_by_name(stage).map_batches_kwargs.update(engine_stage_options())
    return processor


def check_frames(settings: VllmSettings, max_frames: int) -> None:
    """Refuse a sampling plan whose segments could hold more frames than vLLM's video loader keeps."""
    if max_frames > settings.max_video_frames:
        raise ValueError(
            f"max_frames={max_frames} exceeds the {settings.max_video_frames} frames vLLM's video loader keeps per "
            "video (it would drop the rest silently): lower max_frames, or raise max_video_frames together with "
            "the engine's media_io_kwargs"
        )


def sampling_params(max_tokens: int, json_schema: dict | None = None) -> dict[str, Any]:
    """Greedy sampling params of a row; with a schema, vLLM structured outputs constrain the decode."""
    params: dict[str, Any] = {"max_tokens": max(1, int(max_tokens)), "temperature": 0.0}
    if json_schema is not None:
        params["structured_outputs"] = {"json": json.dumps(json_schema)}
    return params


OUTPUT_COLUMNS = (ERROR_KEY, "generated_text", "num_input_tokens", "num_generated_tokens", "time_taken_llm")


def output_columns(row: dict[str, Any]) -> dict[str, Any]:
    """The columns of a processor output row that ``read_output`` needs (a postprocess keeps these)."""
    return {k: row.get(k) for k in OUTPUT_COLUMNS}


@dataclass
class VllmOutput:
    text: str
    input_tokens: int
    output_tokens: int
    latency_s: float
    error: str | None


def read_output(row: dict[str, Any]) -> VllmOutput:
    """A processor output row, success or Ray error row."""
    error = row.get(ERROR_KEY) or row.get("error") or None
    latency = float(row.get("time_taken_llm") or row.get("latency_s") or 0.0)
    if error:
        return VllmOutput("", 0, 0, latency, str(error))
    return VllmOutput(
        text=str(row.get("generated_text", row.get("text", "")) or "").strip(),
        input_tokens=int(row.get("num_input_tokens", row.get("input_tokens", 0)) or 0),
        output_tokens=int(row.get("num_generated_tokens", row.get("output_tokens", 0)) or 0),
        latency_s=latency,
        error=None,
    )
