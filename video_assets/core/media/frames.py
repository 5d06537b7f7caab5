"""Sampled frames as they travel and are kept: JPEG, encoded once where they are decoded.

Raw frames are about 0.6 MB each at the default pixel budget (448 x 448 x 3); a segment's 16 frames are
about 10 MB, and they used to cross Ray's object store several times. As JPEG at ``QUALITY`` they are
about 15x smaller (``make bench``, section frames); every consumer that needs pixels decodes them (``decode``), and the vLLM and endpoint
engines put the bytes in their requests as they are. The same bytes are kept in ``sampled_frames``, so
later stages read the frames the captions saw instead of decoding the video again.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

QUALITY = 90  # JPEG quality of every sampled frame (and of a curated frame's crop)


def encode_one(frame: np.ndarray, quality: int = QUALITY) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame, dtype=np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def encode(frames: np.ndarray, quality: int = QUALITY) -> list[bytes]:
    """(N, H, W, 3) uint8 RGB frames as N JPEGs."""
    return [encode_one(f, quality) for f in frames]


def decode(jpegs: Sequence[bytes]) -> np.ndarray:
    """JPEGs as one (N, H, W, 3) uint8 RGB array (all the same size: one segment's frames); ValueError for
    none, or for bytes that are not an image."""
    from PIL import Image

    if len(jpegs) == 0:
        raise ValueError("no frames")
    try:
        pixels = [np.asarray(Image.open(io.BytesIO(bytes(b))).convert("RGB")) for b in jpegs]
    except (OSError, ValueError) as exc:
        raise ValueError(f"a frame is not a readable image: {exc}") from exc
    if len({p.shape for p in pixels}) > 1:
        raise ValueError(f"frames of different sizes: {sorted({p.shape for p in pixels})}")
    return np.stack(pixels)


def is_encoded(frames) -> bool:
    """Whether ``frames`` is a sequence of encoded images (bytes), not a pixel array."""
    if isinstance(frames, np.ndarray) and frames.dtype != object:
        return False
    return len(frames) > 0 and all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames)


def caption_frames_at(row: dict, times: list[float]) -> tuple[list[float], np.ndarray, str]:
    """The frames at ``times`` (frame times of a video's captions) for a later stage's CPU stage: the
    captions' own JPEGs when ``row`` carries them (``stored_times``, ``stored_images``: what the captions
    step kept in sampled_frames), else decoded from the video again (captions made before that table, or
    rows of it gone). Returns the times found (sorted), the frames, and where they came from
    (``stored`` | ``decoded``), like ``sampling.sample_times``."""
    stored_times, stored_images = row.get("stored_times"), row.get("stored_images")  # numpy arrays from Ray
    if stored_times is None or stored_images is None:
        stored_times, stored_images = [], []
    stored = {float(t): image for t, image in zip(stored_times, stored_images)}
    wanted = sorted({float(t) for t in times})
    if wanted and all(t in stored for t in wanted):
        return wanted, decode([stored[t] for t in wanted]), "stored"
    from video_assets.core.media.sampling import sample_times

    found, pixels = sample_times(row["uri"], wanted, rotation=row.get("rotation"))
    return found, pixels, "decoded"
