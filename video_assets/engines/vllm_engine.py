"""Caption engine on vLLM through Ray Data LLM (``ray.data.llm.build_processor``), for GPU clusters.

Importable without vLLM: Ray's processor config and builder import lazily, and nothing here touches
vLLM until the processor's stages start on GPU workers. Only config building and request shaping can be
exercised on a CPU-only machine.

Pipeline built by ``build_vllm_processor``::

    preprocess (to_vllm_row) ─► PrepareMultimodal (vLLM chat parser: decodes the video part)
        ─► ChatTemplate (the model's HF chat template) ─► vLLM engine ─► postprocess (from_vllm_row)

Frames travel as ONE OpenAI ``video_url`` part whose URL is ``data:video/jpeg;base64,<f1>,<f2>,...``
(vLLM's format for a video given as JPEG frames), next to the same text part the transformers engine
sends (frame timestamps + instruction). The frames' sampling rate goes in ``mm_processor_kwargs``
(``fps``, ``do_sample_frames=False``) so Qwen2.5-VL's temporal positions match the real spacing.
"""

from __future__ import annotations

import base64
import io
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, Field

from video_assets.engines.base import (
    CaptionRequest,
    CaptionResponse,
    build_messages,
    sampled_fps,
    validate_request,
)

ERROR_KEY = "__inference_error__"  # Ray Data LLM's per-row error column; rows carrying it skip all stages
REQUEST_ID_KEY = "caption_request_id"  # Ray's vLLM stage overwrites "request_id" with its own integer id


class VllmSettings(BaseModel):
    model_source: str
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_model_len: int = Field(default=32768, ge=256)
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"video": 1, "image": 0})
    concurrency: int = Field(default=1, ge=1, description="vLLM engine replicas (each tensor_parallel_size GPUs)")
    batch_size: int = Field(default=16, ge=1, description="Rows per Ray Data batch sent to an engine")
    max_new_tokens: int = Field(default=256, ge=1, description="Ceiling on max_tokens per request")
    accelerator_type: str | None = Field(default=None, description='e.g. "H100"; None lets Ray place anywhere')
    dtype: str = "auto"
    jpeg_quality: int = Field(default=90, ge=1, le=100, description="Frames cross Ray as JPEG at this quality")
    should_continue_on_error: bool = Field(default=True, description="A failed row gets an error, not a failed job")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine args (override)")


def engine_kwargs(settings: VllmSettings) -> dict[str, Any]:
    return {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_num_seqs": settings.max_num_seqs,
        "max_model_len": settings.max_model_len,
        "limit_mm_per_prompt": dict(settings.limit_mm_per_prompt),
        "dtype": settings.dtype,
        **settings.engine_kwargs,
    }


def build_processor_config(settings: VllmSettings):
    """The ``ray.data.llm.vLLMEngineProcessorConfig`` for captioning (no vLLM import needed)."""
    from ray.data.llm import vLLMEngineProcessorConfig

    kwargs = engine_kwargs(settings)
    return vLLMEngineProcessorConfig(
        model_source=settings.model_source,
        engine_kwargs=kwargs,
        concurrency=settings.concurrency,
        batch_size=settings.batch_size,
        accelerator_type=settings.accelerator_type,
        should_continue_on_error=settings.should_continue_on_error,
        # vLLM's own chat parser turns the OpenAI video_url part into frames + the model's placeholder.
        prepare_multimodal_stage={
            "enabled": True,
            "model_config_kwargs": {
                "limit_mm_per_prompt": kwargs["limit_mm_per_prompt"],
                "max_model_len": kwargs["max_model_len"],
            },
            "chat_template_content_format": "string",
        },
        chat_template_stage=True,
        # Text prompt + multi_modal_data straight to vLLM: it tokenizes and detokenizes itself, the
        # best-trodden multimodal path (placeholders expand inside vLLM's processor).
        tokenize_stage=False,
        detokenize_stage=False,
    )


def _jpeg_b64(frame, quality: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def video_data_url(frames, quality: int = 90) -> str:
    """vLLM's data URL for a video given as frames: comma-separated base64 JPEGs."""
    return "data:video/jpeg;base64," + ",".join(_jpeg_b64(f, quality) for f in frames)


def to_openai_messages(messages: list[dict[str, Any]], quality: int = 90) -> list[dict[str, Any]]:
    """``build_messages`` output with the video part re-encoded as an OpenAI ``video_url`` part."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "video":
                    parts.append({"type": "video_url", "video_url": {"url": video_data_url(p["video"], quality)}})
                else:
                    parts.append({"type": "text", "text": p["text"]})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def to_vllm_row(request: CaptionRequest, jpeg_quality: int = 90, max_new_tokens: int | None = None) -> dict[str, Any]:
    """One request as the row Ray's vLLM processor expects.

    A malformed request (bad frame array) becomes a row already marked with Ray's error column, so
    every stage skips it and it comes back as a response with ``error`` set.
    """
    limit = request.max_new_tokens if max_new_tokens is None else min(request.max_new_tokens, max_new_tokens)
    row = {
        REQUEST_ID_KEY: request.request_id,
        "messages": [],
        "sampling_params": {"max_tokens": max(1, int(limit)), "temperature": 0.0},
        "mm_processor_kwargs": {"fps": 1.0, "do_sample_frames": False},
        ERROR_KEY: "",
    }
    try:
        frames = validate_request(request)
    except Exception as exc:  # same keys as a good row, so Ray's blocks keep one schema
        return {**row, ERROR_KEY: f"{exc.__class__.__name__}: {exc}"}
    messages = build_messages(CaptionRequest(**{**request.__dict__, "frames": frames}))
    row["messages"] = to_openai_messages(messages, jpeg_quality)
    row["mm_processor_kwargs"]["fps"] = sampled_fps(request.timestamps)
    return row


def from_vllm_row(row: dict[str, Any]) -> CaptionResponse:
    """A processor output row (success or Ray error row) as a ``CaptionResponse``."""
    request_id = str(row.get(REQUEST_ID_KEY, row.get("request_id", "")))
    error = row.get(ERROR_KEY) or row.get("error") or None
    latency = float(row.get("time_taken_llm") or row.get("latency_s") or 0.0)
    if error:
        return CaptionResponse(request_id, "", 0, 0, latency, error=str(error))
    text = row.get("generated_text", row.get("text", "")) or ""
    return CaptionResponse(
        request_id=request_id,
        text=str(text).strip(),
        input_tokens=int(row.get("num_input_tokens", row.get("input_tokens", 0)) or 0),
        output_tokens=int(row.get("num_generated_tokens", row.get("output_tokens", 0)) or 0),
        latency_s=latency,
    )


def _postprocess(row: dict[str, Any]) -> dict[str, Any]:
    return asdict(from_vllm_row(row))


def build_vllm_processor(settings: VllmSettings, preprocess=None, postprocess=None):
    """``ray.data.llm.build_processor`` over ``CaptionRequest`` rows (dicts of its fields) by default.

    Calling this initialises Ray and reads the model's config (Ray's telemetry); the returned
    processor only starts vLLM when the dataset it is applied to executes.
    """
    from ray.data.llm import build_processor

    def _pre(row: dict[str, Any]) -> dict[str, Any]:
        req = CaptionRequest(
            request_id=str(row["request_id"]),
            frames=row["frames"],
            timestamps=list(row["timestamps"]),
            prompt=row["prompt"],
            system=row.get("system"),
            max_new_tokens=int(row.get("max_new_tokens") or settings.max_new_tokens),
        )
        return {**to_vllm_row(req, settings.jpeg_quality, settings.max_new_tokens), "frames": None}

    return build_processor(
        build_processor_config(settings),
        preprocess=preprocess or _pre,
        postprocess=postprocess or _postprocess,
    )


# -- the captioning job's vLLM stage (see video_assets.captioning.caption_rows) -----------------------

_CARRIED = ("video_id", "batch_key", "uri", "segment", "segment_start_s", "segment_end_s", "decode_s")


def _job_result(row: dict[str, Any]) -> dict[str, Any]:
    """A segment row as the job's RESULT_COLUMNS, from a success row or a Ray error row."""
    if "status" in row and "prose" in row:  # already shaped by the postprocess
        return row
    resp = from_vllm_row(row)
    out = {k: row.get(k) for k in _CARRIED}
    out.update(
        frame_timestamps=[float(t) for t in (row.get("frame_timestamps") or [])],
        engine_s=resp.latency_s,
        prose=resp.text,
        input_tokens=resp.input_tokens,
        output_tokens=resp.output_tokens,
        latency_s=resp.latency_s,
        status="error" if resp.error else "ok",
        error=resp.error,
    )
    return out


def build_vllm_processor_for_job(ds, spec):
    """Apply the vLLM processor to the job's segment rows (video_id, segment, frames, frame_timestamps, ...)."""
    settings = VllmSettings(**spec.vllm)

    def _pre(row: dict[str, Any]) -> dict[str, Any]:
        req = CaptionRequest(
            request_id=f"{row['video_id']}:{row['segment']}",
            frames=row["frames"],
            timestamps=[float(t) for t in row["frame_timestamps"]],
            prompt=spec.prompt,
            max_new_tokens=settings.max_new_tokens,
        )
        # frames=None: the JPEGs in the messages carry them; don't ship the raw array through every stage.
        return {**to_vllm_row(req, settings.jpeg_quality, settings.max_new_tokens), "frames": None}

    processor = build_vllm_processor(settings, preprocess=_pre, postprocess=_job_result)
    # Ray's error rows bypass the postprocess; shape them too.
    return processor(ds).map(_job_result)
