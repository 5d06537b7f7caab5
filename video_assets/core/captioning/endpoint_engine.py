"""Caption engine on an OpenAI-compatible endpoint (``VLM_ENGINE=endpoint``, ``core.inference.endpoint``).

Each segment is one chat completion. To a server that takes video (vLLM's OpenAI server, the served caption
application: ``Endpoint.video``) it is the request every engine gets (``requests.video_chat_body``: one video
part, its timing as ``video_metadata``); to one that does not (a hosted API has no ``video_url``), the sampled
frames as image parts, each after a text part with its time in the source video, then the same timing line
and instruction, so the times stated in the text carry what a video part's timing would.

    decode tasks (JPEG) ─► preprocess (payload) ─► request stage (EndpointRequests) ─► postprocess (RESULT_COLUMNS)
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from video_assets.core.captioning.requests import CaptionRequest, format_seconds, timestamps_text, video_chat_body
from video_assets.core.captioning.rows import decode_error, result_row
from video_assets.core.inference.endpoint import (
    Endpoint,
    error_row,
    payload_row,
    read_answer,
    request_stage,
)
from video_assets.core.media import frames


def jpeg_data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(bytes(jpeg)).decode("ascii")


def caption_payload(
    model: str, images, timestamps: list[float], prompt: str, max_tokens: int, video: bool = False
) -> dict:
    """The chat completion request for one segment (greedy, like the in-job engines). ``images``: the
    segment's JPEGs (the CPU stage's, sent as they are), or an (N, H, W, 3) array encoded here. ``video``:
    the server takes a video part (vLLM's server, the served caption application): the request every engine
    gets (``requests.video_chat_body``: one video, its timing as metadata); else one image part per frame,
    each after its time, for servers without video (a hosted API)."""
    if not frames.is_encoded(images):
        pixels = np.asarray(images)
        if pixels.ndim != 4 or pixels.shape[-1] != 3:
            raise ValueError(f"frames must be (N, H, W, 3), got {pixels.shape}")
        images = frames.encode(pixels)
    if len(images) == 0 or len(images) != len(timestamps):
        raise ValueError(f"need one timestamp per frame, got {len(images)} frames and {len(timestamps)} timestamps")
    head = {"model": model, "max_tokens": int(max_tokens), "temperature": 0.0}
    if video:
        request = CaptionRequest("", list(images), list(timestamps), prompt, max_new_tokens=int(max_tokens))
        return {**head, **video_chat_body(request)}
    content: list[dict[str, Any]] = []
    for jpeg, t in zip(images, timestamps):
        content.append({"type": "text", "text": f"Frame at {format_seconds(t)}:"})
        content.append({"type": "image_url", "image_url": {"url": jpeg_data_url(jpeg)}})
    content.append({"type": "text", "text": f"{timestamps_text(list(timestamps))}\n{prompt}"})
    return {**head, "messages": [{"role": "user", "content": content}]}


def _job_result(row: dict[str, Any]) -> dict[str, Any]:
    """A segment row as the job's RESULT_COLUMNS, from an answer or an error row (decode or request)."""
    answer = read_answer(row)
    error = answer.caption_error("the endpoint")
    return result_row(row, answer.text, answer.input_tokens, answer.output_tokens, answer.latency_s, error)


def build_endpoint_processor_for_job(ds, spec):
    """Apply the endpoint's HTTP processor to the job's segment rows."""
    endpoint = Endpoint(**spec.endpoint)

    def _pre(row: dict[str, Any]) -> dict[str, Any]:
        if error := decode_error(row.get("decode_error")):  # the CPU stage's error row: skips the request
            out = error_row(error)
        else:
            try:
                payload = caption_payload(
                    endpoint.model,
                    row["frames"],
                    [float(t) for t in row["frame_timestamps"]],
                    spec.prompt,
                    spec.engine.max_new_tokens,
                    endpoint.video,
                )
                out = payload_row(payload)
            except Exception as exc:
                out = error_row(f"{exc.__class__.__name__}: {exc}")
        # Merged into the row by Ray; the row's frames (JPEGs) go on to the result: the captions step keeps them.
        return out

    return request_stage(ds, endpoint, _pre, _job_result)


class EndpointEngine:
    """The captioning engine interface (``generate``: CaptionRequests in, CaptionResponses out) on an endpoint,
    for a Ray Data actor that holds no model (curation's frame descriptions): the same chat request per
    request (``caption_payload``) and the same per-request bounds as the captions job (``EndpointRequests``)."""

    def __init__(self, endpoint: dict):
        from video_assets.core.inference.endpoint import EndpointRequests

        self.endpoint = Endpoint(**endpoint)
        self.stage = EndpointRequests(self.endpoint)
        self._loop = None

    def generate(self, requests: list) -> list:
        import asyncio

        from video_assets.core.captioning.requests import CaptionResponse
        from video_assets.core.inference.endpoint import PAYLOAD, RESPONSE
        from video_assets.core.inference.vllm import ERROR_KEY

        rows = []
        for q in requests:
            try:
                payload = caption_payload(
                    self.endpoint.model, q.frames, list(q.timestamps), q.prompt, q.max_new_tokens, self.endpoint.video
                )
                rows.append(payload_row(payload))
            except Exception as exc:
                rows.append(error_row(f"{exc.__class__.__name__}: {exc}"))
        if self._loop is None:  # one loop for the actor's life: the stage's HTTP session lives on it
            self._loop = asyncio.new_event_loop()
        out = self._loop.run_until_complete(
            self.stage({PAYLOAD: [r[PAYLOAD] for r in rows], ERROR_KEY: [r[ERROR_KEY] for r in rows]})
        )
        responses = []
        for i, q in enumerate(requests):
            answer = read_answer(
                {ERROR_KEY: out[ERROR_KEY][i], RESPONSE: out[RESPONSE][i], "endpoint_s": out["endpoint_s"][i]}
            )
            error = answer.caption_error("the endpoint")
            responses.append(
                CaptionResponse(
                    q.request_id,
                    answer.text if not error else "",
                    answer.input_tokens,
                    answer.output_tokens,
                    answer.latency_s,
                    error,
                )
            )
        return responses
