"""Pure, vectorised quality scores of RGB uint8 frames, and the keep/drop verdict of each frame.

Every score is computed on the luma (BT.601) of the frame in 0-255 units:

- ``sharpness``: variance of the 4-neighbour Laplacian inside the crop box (bars have no detail and
  their edge is one strong line, so both are left out);
- ``brightness`` / ``contrast``: mean and standard deviation of the luma inside the crop box;
- ``motion``: mean absolute luma difference to the previous sampled frame at 64x36 (None for the first);
- ``crop box``: the black borders (letterbox, pillarbox) are the rows / columns from each edge whose
  maximum luma stays under ``border_max_luma``; a frame that is dark all over is not cropped;
- ``phash``: 64-bit DCT perceptual hash (32x32 grey, 2-D DCT-II, top-left 8x8 against its median);
  near duplicates are a small Hamming distance apart.

``curate`` turns the scores of one video's frames (in time order) into a ``FrameVerdict`` each, with the
first failed test as the reason (order: dark, washed_out, flat, blurry, static, duplicate).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np
from PIL import Image

from video_assets.core.vocabulary import (
    CURATION_BLURRY,
    CURATION_DARK,
    CURATION_DUPLICATE,
    CURATION_FLAT,
    CURATION_KEPT,
    CURATION_STATIC,
    CURATION_WASHED_OUT,
)

MOTION_SIZE = (64, 36)  # (w, h): the low resolution motion is measured at (as media.sampling does)
HASH_SIZE, HASH_LOW = 32, 8


@dataclass(frozen=True)
class CurationConfig:
    """Thresholds of the filters (luma in 0-255 units); defaults measured on the sample corpus (README,
    "Frame curation"). A filter is off when its threshold is set so it can never fire (e.g. 0)."""

    dark_max_brightness: float = 40.0  # mean luma below this: dark
    washed_out_min_brightness: float = 235.0  # mean luma above this: washed out
    min_contrast: float = 10.0  # luma std below this: flat (an empty, uniform frame)
    min_sharpness: float = 12.0  # Laplacian variance below this: blurry
    min_motion: float = 0.5  # mean abs luma difference to the previous sampled frame below this: static
    duplicate_max_distance: int = 4  # pHash Hamming distance to a kept frame at or below this: duplicate
    border_max_luma: float = 32.0  # a border row/column's max luma stays below this
    border_min_keep: float = 0.5  # never crop to less than this share of the width or height
    jpeg_quality: int = 90  # JPEG quality of the stored (cropped) kept frames

    def __post_init__(self):
        if not 0 <= self.dark_max_brightness <= self.washed_out_min_brightness <= 256:
            raise ValueError("need 0 <= dark_max_brightness <= washed_out_min_brightness <= 256")
        if self.min_contrast < 0 or self.min_sharpness < 0 or self.min_motion < 0:
            raise ValueError("min_contrast, min_sharpness and min_motion must be >= 0")
        if not -1 <= self.duplicate_max_distance <= 64:
            raise ValueError("duplicate_max_distance must be in [-1, 64] (-1: off)")
        if not 0 < self.border_min_keep <= 1 or not 1 <= self.jpeg_quality <= 100:
            raise ValueError("border_min_keep must be in (0, 1] and jpeg_quality in [1, 100]")

    @classmethod
    def from_dict(cls, values: dict) -> CurationConfig:
        """A config from e.g. a use case's ``[curation]`` table; an unknown key is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown curation settings {unknown}; known: {sorted(known)}")
        return cls(**values)

    def version(self, **extra) -> str:
        """Hash of the thresholds (and of ``extra``: e.g. the description prompt and model): the
        ``curation_version`` of the rows curated with them."""
        data = json.dumps({**asdict(self), **extra}, sort_keys=True, default=str)
        return hashlib.sha256(data.encode()).hexdigest()[:12]


@dataclass
class FrameVerdict:
    timestamp_s: float
    kept: bool
    reason: str
    sharpness: float
    brightness: float
    contrast: float
    motion: float | None
    crop: tuple[int, int, int, int]  # x0, y0, x1, y1 (exclusive ends) of the picture without borders
    phash: str  # 16 hex characters
    duplicate_of: float | None = field(default=None)  # time of the kept frame it repeats


# ---------------------------------------------------------------- scores


def luma(frames: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) or (H, W, 3) uint8 RGB -> float32 luma of the same leading shape, 0-255."""
    f = np.asarray(frames, dtype=np.float32)
    return f[..., 0] * 0.299 + f[..., 1] * 0.587 + f[..., 2] * 0.114


def laplacian_variance(grey: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian of a 2-D grey image (0 for an image under 3x3)."""
    g = np.asarray(grey, dtype=np.float32)
    if g.shape[0] < 3 or g.shape[1] < 3:
        return 0.0
    lap = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4 * g[1:-1, 1:-1]
    return float(lap.var())


def border_box(grey: np.ndarray, max_luma: float = 32.0, min_keep: float = 0.5) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) of a 2-D grey frame without its black bars: the rows and columns from each edge
    whose maximum stays under ``max_luma``. The whole frame when it is dark all over, or when the bars
    would leave less than ``min_keep`` of a side (a dark scene is not a border)."""
    h, w = grey.shape
    bright_rows = np.flatnonzero(grey.max(axis=1) >= max_luma)
    bright_cols = np.flatnonzero(grey.max(axis=0) >= max_luma)
    if not len(bright_rows) or not len(bright_cols):
        return 0, 0, w, h
    y0, y1 = int(bright_rows[0]), int(bright_rows[-1]) + 1
    x0, x1 = int(bright_cols[0]), int(bright_cols[-1]) + 1
    if (y1 - y0) < min_keep * h:
        y0, y1 = 0, h
    if (x1 - x0) < min_keep * w:
        x0, x1 = 0, w
    return x0, y0, x1, y1


def _resize_grey(grey: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    im = Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8))
    return np.asarray(im.resize(size, Image.Resampling.BOX), dtype=np.float32)


def motion_score(prev_grey: np.ndarray, grey: np.ndarray) -> float:
    """Mean absolute luma difference (0-255) of two grey frames at 64x36."""
    return float(np.abs(_resize_grey(grey, MOTION_SIZE) - _resize_grey(prev_grey, MOTION_SIZE)).mean())


def _dct_matrix(n: int) -> np.ndarray:
    k = np.arange(n)[:, None]
    m = np.cos(np.pi * (2 * np.arange(n)[None, :] + 1) * k / (2 * n)) * np.sqrt(2 / n)
    m[0] /= np.sqrt(2)
    return m


_DCT = _dct_matrix(HASH_SIZE)


def phash(grey: np.ndarray) -> int:
    """64-bit DCT perceptual hash of a 2-D grey image: 32x32, 2-D DCT-II, the top-left 8x8 coefficients
    compared with their median (bit 63 is coefficient (0, 0))."""
    small = _resize_grey(grey, (HASH_SIZE, HASH_SIZE))
    low = (_DCT @ small @ _DCT.T)[:HASH_LOW, :HASH_LOW].ravel()
    bits = low > np.median(low)
    return int("".join("1" if b else "0" for b in bits), 2)


def phash_hex(value: int) -> str:
    return f"{value:016x}"


def hamming(a: int | str, b: int | str) -> int:
    """Bits that differ between two hashes (ints or hex strings)."""
    a = int(a, 16) if isinstance(a, str) else a
    b = int(b, 16) if isinstance(b, str) else b
    return (a ^ b).bit_count()


@dataclass
class Scores:
    sharpness: float
    brightness: float
    contrast: float
    crop: tuple[int, int, int, int]
    phash: int


def frame_scores(frame: np.ndarray, config: CurationConfig = CurationConfig()) -> Scores:
    """The scores of one RGB frame that need no other frame."""
    grey = luma(frame)
    x0, y0, x1, y1 = box = border_box(grey, config.border_max_luma, config.border_min_keep)
    inner = grey[y0:y1, x0:x1]
    return Scores(
        sharpness=laplacian_variance(inner),
        brightness=float(inner.mean()),
        contrast=float(inner.std()),
        crop=box,
        phash=phash(inner),
    )


def crop(frame: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    x0, y0, x1, y1 = box
    return frame[y0:y1, x0:x1]


# ---------------------------------------------------------------- verdicts


def curate(frames, timestamps: list[float], config: CurationConfig = CurationConfig()) -> list[FrameVerdict]:
    """One verdict per frame of one video, frames in time order. Motion is measured against the previous
    sampled frame; a duplicate is a frame within ``duplicate_max_distance`` of any frame kept before it
    in the video (so of a run of near-identical frames, the first sharp one is kept)."""
    if len(frames) != len(timestamps):
        raise ValueError(f"{len(frames)} frames but {len(timestamps)} timestamps")
    order = sorted(range(len(timestamps)), key=lambda i: timestamps[i])
    out: dict[int, FrameVerdict] = {}
    kept: list[tuple[int, float]] = []  # (phash, time) of the frames kept so far
    prev = None
    for i in order:
        grey = luma(frames[i])
        s = frame_scores(frames[i], config)
        motion = motion_score(prev, grey) if prev is not None else None
        prev = grey
        twin = next((t for h, t in kept if hamming(h, s.phash) <= config.duplicate_max_distance), None)
        if s.brightness < config.dark_max_brightness:
            reason = CURATION_DARK
        elif s.brightness > config.washed_out_min_brightness:
            reason = CURATION_WASHED_OUT
        elif s.contrast < config.min_contrast:
            reason = CURATION_FLAT
        elif s.sharpness < config.min_sharpness:
            reason = CURATION_BLURRY
        elif motion is not None and motion < config.min_motion:
            reason = CURATION_STATIC
        elif twin is not None:
            reason = CURATION_DUPLICATE
        else:
            reason = CURATION_KEPT
            kept.append((s.phash, float(timestamps[i])))
        out[i] = FrameVerdict(
            timestamp_s=float(timestamps[i]),
            kept=reason == CURATION_KEPT,
            reason=reason,
            sharpness=s.sharpness,
            brightness=s.brightness,
            contrast=s.contrast,
            motion=motion,
            crop=s.crop,
            phash=phash_hex(s.phash),
            duplicate_of=twin if reason == CURATION_DUPLICATE else None,
        )
    return [out[i] for i in range(len(timestamps))]
