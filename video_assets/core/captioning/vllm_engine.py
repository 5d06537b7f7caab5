"""Caption engine on vLLM through Ray Data LLM (``ray.data.llm.build_processor``), for GPU clusters.

Importable without vLLM: Ray's processor config and builder import lazily, and nothing here touches
vLLM until the processor's stages start on GPU workers. Only config building and request shaping can be
exercised on a CPU-only machine.

Pipeline built by ``build_vllm_processor``::

    preprocess (to_vllm_row) ─► PrepareMultimodal (vLLM chat parser: decodes the video part)
        ─► ChatTemplate (the model's HF chat template) ─► vLLM engine ─► postprocess (from_vllm_row)

Frames travel as ONE OpenAI ``video_url`` part whose URL is ``data:video/jpeg;base64,<f1>,<f2>,...``
(vLLM's format for a video given as JPEG frames: the CPU stage's JPEGs, not encoded again), next to the
same text part the transformers engine sends (frame timestamps + instruction). The frames' timing goes in ``mm_processor_kwargs`` as
``video_metadata`` (``requests.video_metadata``, the dict the transformers engine builds its
``VideoMetadata`` from) with ``do_sample_frames=False``. Not ``fps``: vLLM 0.29's Qwen2-VL parser drops
both that kwarg and the JPEG loader's ``media_io_kwargs`` metadata, and transformers then assumes 24 fps.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from video_assets.core.captioning.requests import (
    CaptionRequest,
    CaptionResponse,
    video_chat_body,
    video_metadata,
)
from video_assets.core.captioning.rows import decode_error, result_row
from video_assets.core.inference.vllm import (
    ERROR_KEY,
    VllmSettings,
    bounded_engine_retries,
    fetch_model_on_nodes,
    processor_config,
    read_output,
    sampling_params,
)
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

REQUEST_ID_KEY = "caption_request_id"  # Ray's vLLM stage overwrites "request_id" with its own integer id


def build_processor_config(settings: VllmSettings, segment_mb: float | None = None):
    """The ``ray.data.llm.vLLMEngineProcessorConfig`` for captioning (no vLLM import needed); ``segment_mb``
    bounds the frames queued per engine (``inference.vllm.concurrent_batches``)."""
    return processor_config(settings, multimodal=True, segment_mb=segment_mb)


def to_vllm_row(request: CaptionRequest, max_new_tokens: int | None = None) -> dict[str, Any]:
    """One request as the row Ray's vLLM processor expects.

    A malformed request (bad frame array) becomes a row already marked with Ray's error column, so
    every stage skips it and it comes back as a response with ``error`` set.
    """
    limit = request.max_new_tokens if max_new_tokens is None else min(request.max_new_tokens, max_new_tokens)
    row = {
        REQUEST_ID_KEY: request.request_id,
        "messages": [],
        "sampling_params": sampling_params(limit),
        # One schema for every row (Ray unifies blocks): an error row carries a one-frame placeholder. A
        # dict, not a list of one: Ray's stages see a list of dicts as a numpy object array, which the
        # processor refuses (a dict's list field arrives as a numpy array, which it takes).
        "mm_processor_kwargs": {"do_sample_frames": False, "video_metadata": video_metadata([0.0])},
        ERROR_KEY: "",
    }
    try:
        body = video_chat_body(request)
    except Exception as exc:  # same keys as a good row, so Ray's blocks keep one schema
        return {**row, ERROR_KEY: f"{exc.__class__.__name__}: {exc}"}
    row["messages"] = body["messages"]
    row["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    return row


def from_vllm_row(row: dict[str, Any]) -> CaptionResponse:
    """A processor output row (success or Ray error row) as a ``CaptionResponse``."""
    out = read_output(row)
    request_id = str(row.get(REQUEST_ID_KEY, row.get("request_id", "")))
    return CaptionResponse(request_id, out.text, out.input_tokens, out.output_tokens, out.latency_s, error=out.error)


def _postprocess(row: dict[str, Any]) -> dict[str, Any]:
    return asdict(from_vllm_row(row))


def build_vllm_processor(
    settings: VllmSettings, preprocess=None, postprocess=None, segment_mb: float | None = None, fetch=None
):
    """``ray.data.llm.build_processor`` over ``CaptionRequest`` rows (dicts of its fields) by default.
    ``fetch``: the registered model's files, fetched by each stage on its node (``vllm.fetch_model_on_nodes``).

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
        return {**to_vllm_row(req, settings.max_new_tokens), "frames": None}

    processor = build_processor(
        build_processor_config(settings, segment_mb),
        preprocess=preprocess or _pre,
        postprocess=postprocess or _postprocess,
    )
    processor = bounded_engine_retries(processor)
    return fetch_model_on_nodes(processor, fetch) if fetch is not None else processor


# -- the captioning job's vLLM stage (see video_assets.captioning.caption_rows) -----------------------


def _job_result(row: dict[str, Any]) -> dict[str, Any]:
    """A segment row as the job's RESULT_COLUMNS, from a success row or a Ray error row."""
    if row.get("status") in (CAPTION_OK, CAPTION_ERROR):  # already shaped by the postprocess
        return row  # (rows that skipped it carry the column too, as null: Ray unifies the schema)

    resp = from_vllm_row(row)
    return result_row(row, resp.text, resp.input_tokens, resp.output_tokens, resp.latency_s, resp.error)


def segment_vllm_row(row: dict[str, Any], prompt: str, settings: VllmSettings) -> dict[str, Any]:
    """A decoded segment row's caption request as the in-job vLLM engines' row (the messages and video timing an
    endpoint gets too, ``requests.video_chat_body``); the CPU stage's error row carries Ray's error column, so
    every stage skips it."""
    req = CaptionRequest(
        request_id=f"{row['video_id']}:{row['segment']}",
        frames=row["frames"],
        timestamps=[float(t) for t in row["frame_timestamps"]],
        prompt=prompt,
        max_new_tokens=settings.max_new_tokens,
    )
    out = to_vllm_row(req, settings.max_new_tokens)
    if error := decode_error(row.get("decode_error")):
        out = {**out, "messages": [], ERROR_KEY: error}
    return out


def build_vllm_processor_for_job(ds, spec, fetch=None):
    """Apply the vLLM processor to the job's segment rows (video_id, segment, frames, frame_timestamps, ...).
    ``fetch``: as ``build_vllm_processor``'s."""

    settings = VllmSettings(**spec.vllm)

    def _pre(row: dict[str, Any]) -> dict[str, Any]:
        # The row's frames (JPEGs) go on to the result: the captions step keeps them.
        return segment_vllm_row(row, spec.prompt, settings)

    # A segment's frames as Ray's multimodal stage hands them to the engine: decoded, up to the plan's cap.
    segment_mb = spec.sampling.max_frames * spec.sampling.max_pixels * 3 / 1e6
    processor = build_vllm_processor(
        settings, preprocess=_pre, postprocess=_job_result, segment_mb=segment_mb, fetch=fetch
    )
    # Ray's error rows bypass the postprocess; shape them too.
    return processor(ds).map(_job_result)
