"""The one interface every caption engine implements, and the chat messages both engines send.

Frames travel as ONE video content part (not N image parts), so Qwen2.5-VL sees a video: its vision
tower merges frame pairs temporally and M-RoPE gives the frames temporal positions. The absolute times
of the frames are stated in the text, so the model can answer with times in the source video.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


@dataclass
class CaptionRequest:
    request_id: str
    frames: np.ndarray  # (N, H, W, 3) uint8 RGB, already resized to the model's pixel budget
    timestamps: list[float]  # seconds of each frame in the source video
    prompt: str  # user instruction text
    system: str | None = None
    max_new_tokens: int = 128


@dataclass
class CaptionResponse:
    request_id: str
    text: str
    input_tokens: int
    output_tokens: int
    latency_s: float
    error: str | None = None  # set (and text "") when this request failed; other requests in the batch still answer


def failed(request_id: str, error: str, latency_s: float = 0.0) -> CaptionResponse:
    return CaptionResponse(
        request_id=request_id, text="", input_tokens=0, output_tokens=0, latency_s=latency_s, error=error
    )


def format_seconds(t: float) -> str:
    """1.0 -> "1.0s", 0.25 -> "0.25s", 12.5 -> "12.5s" (centisecond precision)."""
    text = f"{float(t):.2f}".rstrip("0")
    return (text + "0" if text.endswith(".") else text) + "s"


def timestamps_text(timestamps: list[float]) -> str:
    times = ", ".join(format_seconds(t) for t in timestamps)
    return f"Frames sampled at {times} (times in the source video)."


def validate_request(request: CaptionRequest) -> np.ndarray:
    """The request's frames as a contiguous (N, H, W, 3) uint8 array; ValueError when malformed."""
    frames = np.asarray(request.frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be (N, H, W, 3) RGB, got shape {frames.shape}")
    n, h, w, _ = frames.shape
    if n == 0 or h == 0 or w == 0:
        raise ValueError(f"frames must be non-empty, got shape {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    if len(request.timestamps) != n:
        raise ValueError(f"{n} frames but {len(request.timestamps)} timestamps")
    return np.ascontiguousarray(frames)


def sampled_fps(timestamps: list[float]) -> float:
    """Frames per second of the sampled frames: what Qwen's temporal positions are scaled by.

    Qwen2.5-VL gives frame pair k the temporal position k * (2 / fps) * tokens_per_second, i.e. it
    assumes uniform spacing; we use the mean spacing of the timestamps (1 fps for a single frame).
    """
    ts = [float(t) for t in timestamps]
    if len(ts) < 2:
        return 1.0
    span = ts[-1] - ts[0]
    if span <= 0:
        return 1.0
    return (len(ts) - 1) / span


def video_metadata(timestamps: list[float]) -> dict[str, Any]:
    """The video metadata both engines hand the model's processor, as a plain dict (it travels in Ray rows).

    The frames are the whole, already sampled clip: ``frames_indices`` is every frame and ``fps`` the
    sampled rate, so transformers' ``VideoMetadata.sampled_fps`` equals ``sampled_fps(timestamps)`` and
    Qwen2.5-VL's ``second_per_grid_ts`` (temporal_patch_size / sampled fps) matches the frames' real spacing.
    Without it the processor assumes 24 fps: a 30 s clip sampled at 0.5 fps looks 1.3 s long.
    """
    n = len(timestamps)
    fps = sampled_fps(timestamps)
    return {"total_num_frames": n, "fps": fps, "duration": n / fps, "frames_indices": list(range(n))}


def build_messages(request: CaptionRequest) -> list[dict[str, Any]]:
    """Chat messages for one request: optional system turn, then one user turn holding exactly one
    video part (the frames) followed by one text part (the frame times, then the instruction).

    The video part is ``{"type": "video", "video": frames, "timestamps": [...], "fps": f}``; the
    Qwen2-VL chat template renders it as ``<|vision_start|><|video_pad|><|vision_end|>``. The
    transformers engine hands ``video`` to the processor; the vLLM engine re-encodes it as an
    OpenAI ``video_url`` part (see ``vllm_engine.to_vllm_row``).
    """
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": [{"type": "text", "text": request.system}]})
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "video",
                    "video": request.frames,
                    "timestamps": [float(t) for t in request.timestamps],
                    "fps": sampled_fps(request.timestamps),
                },
                {"type": "text", "text": f"{timestamps_text(request.timestamps)}\n{request.prompt}"},
            ],
        }
    )
    return messages


def video_part(messages: list[dict[str, Any]]) -> dict[str, Any]:
    parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "video"]
    if len(parts) != 1:
        raise ValueError(f"expected exactly one video part, found {len(parts)}")
    return parts[0]


def video_data_url(jpegs: Sequence[bytes]) -> str:
    """vLLM's data URL for a video given as frames: comma-separated base64 JPEGs."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(bytes(j)).decode("ascii") for j in jpegs)


def request_jpegs(request: CaptionRequest) -> list[bytes]:
    """The request's frames as JPEGs: as the job's CPU stage encoded them (put in the request unchanged),
    else a pixel array encoded here; ValueError when malformed."""
    from video_assets.core.media import frames  # here: the GPU check imports this module with torch alone

    if frames.is_encoded(request.frames):
        if len(request.frames) != len(request.timestamps):
            raise ValueError(f"{len(request.frames)} frames but {len(request.timestamps)} timestamps")
        return [bytes(j) for j in request.frames]
    return frames.encode(validate_request(request))


def to_openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``build_messages`` output (its video part holding JPEGs) with the video as an OpenAI ``video_url`` part."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "video":
                    parts.append({"type": "video_url", "video_url": {"url": video_data_url(p["video"])}})
                else:
                    parts.append({"type": "text", "text": p["text"]})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def video_chat_body(request: CaptionRequest) -> dict[str, Any]:
    """THE caption request of a segment, as an OpenAI chat completion's ``messages`` and vLLM's
    ``mm_processor_kwargs``: one ``video_url`` part (the frames as JPEGs) and the text part with the frame
    times and the instruction; the frames' timing as ``video_metadata`` with ``do_sample_frames=False``. The
    in-job vLLM engine, an endpoint that takes video (vLLM's server, the served caption application) and,
    through ``VideoChat``, the in-job transformers engine all get this. ValueError when malformed."""
    jpegs = request_jpegs(request)
    return {
        "messages": to_openai_messages(build_messages(replace(request, frames=jpegs))),
        "mm_processor_kwargs": {"do_sample_frames": False, "video_metadata": video_metadata(request.timestamps)},
    }


@dataclass
class VideoChat:
    """A caption request as the transformers engine runs it: chat messages holding one video part, that
    video's frames (pixels) and metadata (``video_metadata``). Built from a ``CaptionRequest`` in the job
    (``of``), or from the OpenAI request ``video_chat_body`` made of it (``from_openai``): the same frames,
    text and timing either way."""

    request_id: str
    messages: list[dict[str, Any]]
    frames: np.ndarray
    metadata: dict[str, Any]
    max_new_tokens: int

    @classmethod
    def of(cls, request: CaptionRequest) -> VideoChat:
        pixels = validate_request(request)
        return cls(
            request.request_id,
            build_messages(replace(request, frames=pixels)),
            pixels,
            video_metadata(request.timestamps),
            request.max_new_tokens,
        )

    @classmethod
    def from_openai(cls, request_id: str, body: dict[str, Any], max_new_tokens: int) -> VideoChat:
        """An OpenAI chat request with exactly one video: a ``video_url`` part of JPEG frames (its timing from
        ``mm_processor_kwargs.video_metadata``, else one frame a second), or image parts taken as the frames of
        one video. ValueError naming what is wrong."""
        jpegs: list[bytes] = []
        videos = 0
        messages = []
        for m in body.get("messages") or []:
            content = m.get("content")
            if isinstance(content, str):
                messages.append({"role": m.get("role", "user"), "content": [{"type": "text", "text": content}]})
                continue
            if not isinstance(content, list):
                raise ValueError("a message's content must be text or a list of parts")
            parts, texts = [], []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text":
                    texts.append(str(p.get("text", "")))
                elif kind in ("video_url", "image_url"):
                    url = str((p.get(kind) or {}).get("url", ""))
                    head, _, data = url.partition(",")
                    if not head.startswith("data:") or not head.endswith(";base64"):
                        raise ValueError(f"{kind} must be a base64 data URL (no URL is fetched)")
                    chunks = data.split(",") if kind == "video_url" else [data]
                    try:
                        jpegs += [base64.b64decode(c, validate=True) for c in chunks]
                    except ValueError as exc:
                        raise ValueError(f"{kind}: not base64 ({exc})") from None
                    if not parts:
                        parts.append({"type": "video"})
                    videos += kind == "video_url"
                else:
                    raise ValueError(f"unsupported content part {kind!r}")
            if texts:
                parts.append({"type": "text", "text": "\n".join(texts)})
            messages.append({"role": m.get("role", "user"), "content": parts})
        if videos > 1 or not jpegs:
            raise ValueError(f"expected one video (or its frames as images), got {videos} videos, {len(jpegs)} frames")
        from video_assets.core.media import frames

        pixels = frames.decode(jpegs)
        metadata = (body.get("mm_processor_kwargs") or {}).get("video_metadata") or video_metadata(
            [float(i) for i in range(len(pixels))]
        )
        if int(metadata.get("total_num_frames", len(pixels))) != len(pixels):
            raise ValueError(
                f"video_metadata says {metadata.get('total_num_frames')} frames, the video has {len(pixels)}"
            )
        for m in messages:
            for p in m["content"]:
                if p["type"] == "video":
                    p["video"] = pixels
        return cls(request_id, messages, pixels, dict(metadata), int(max_new_tokens))
