"""Caption engine on an OpenAI-compatible endpoint (``VLM_ENGINE=endpoint``, ``core.inference.endpoint``).

Each segment is one chat completion: the sampled frames as image content parts, each after a text part
with its time in the source video, then the same timing line and instruction both in-job engines send.
Image parts, not a video part: every OpenAI-compatible VLM server takes them (a hosted API has no
``video_url``), and the times stated in the text carry what a video part's timing would.

    decode tasks ─► preprocess (JPEG, payload) ─► HTTP stage (Ray Data LLM) ─► postprocess (RESULT_COLUMNS)
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

from video_assets.core.captioning.requests import format_seconds, timestamps_text
from video_assets.core.captioning.rows import decode_error, result_row
from video_assets.core.inference.endpoint import (
    Endpoint,
    build_processor,
    error_row,
    payload_row,
    read_answer,
)
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

JPEG_QUALITY = 90


def jpeg_data_url(frame: np.ndarray, quality: int = JPEG_QUALITY) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8)).save(buf, format="JPEG", quality=quality)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def caption_payload(model: str, frames: np.ndarray, timestamps: list[float], prompt: str, max_tokens: int) -> dict:
    """The chat completion request for one segment (greedy, like the in-job engines)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0 or len(frames) != len(timestamps):
        raise ValueError(f"frames must be (N, H, W, 3) with one timestamp each, got {frames.shape}, {len(timestamps)}")
    content: list[dict[str, Any]] = []
    for frame, t in zip(frames, timestamps):
        content.append({"type": "text", "text": f"Frame at {format_seconds(t)}:"})
        content.append({"type": "image_url", "image_url": {"url": jpeg_data_url(frame)}})
    content.append({"type": "text", "text": f"{timestamps_text(list(timestamps))}\n{prompt}"})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
    }


def _job_result(row: dict[str, Any]) -> dict[str, Any]:
    """A segment row as the job's RESULT_COLUMNS, from an answer or an error row (decode or request)."""
    if row.get("status") in (CAPTION_OK, CAPTION_ERROR):  # already shaped by the postprocess
        return row
    answer = read_answer(row)
    error = answer.error or (None if answer.text else "the endpoint answered with no text")
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
                )
                out = payload_row(payload)
            except Exception as exc:
                out = error_row(f"{exc.__class__.__name__}: {exc}")
        # Merged into the row by Ray; frames=None: the JPEGs in the payload carry them, the raw array goes no further.
        return {**out, "frames": None}

    processor = build_processor(endpoint, preprocess=_pre, postprocess=_job_result)
    # Ray's error rows bypass the postprocess; shape them too.
    return processor(ds).map(_job_result)
