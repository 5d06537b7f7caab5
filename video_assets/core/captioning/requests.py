"""The one interface every caption engine implements, and the chat messages both engines send.

Frames travel as ONE video content part (not N image parts), so Qwen2.5-VL sees a video: its vision
tower merges frame pairs temporally and M-RoPE gives the frames temporal positions. The absolute times
of the frames are stated in the text, so the model can answer with times in the source video.
"""

from __future__ import annotations

from dataclasses import dataclass
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
