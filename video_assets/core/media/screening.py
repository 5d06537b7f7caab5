"""Frames screened before the engine: a sampled frame that carries almost no picture (black, blank,
smeared, or a frozen repeat of the frame before) is replaced by the nearest useful frame after it within
its slot, decoded anyway on the way to the next target (``sampling._iter_collect``).

The scores are curation's (``core.curation.quality``: mean and standard deviation of the luma, variance of
its Laplacian, mean absolute difference to the previous frame at 64x36), computed on one pixel in 4 x 4 of
the RGB frame the model would see (about 0.2 ms a 448x252 frame). The defaults are far stricter than
curation's: a night scene, a fade or a grey sky with a plane in it stays (the sample corpus: only the
almost-black WebM is flagged, and it has no useful frame to take instead). Nothing is dropped: a frame
without a useful one within ``lookahead_frames`` and before the next target stays as it was, so a
segment never loses a frame and a clip that is dark all through is captioned as before.

Pure (numpy): testable without Ray or Dagster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from video_assets.core.curation.quality import laplacian_variance, luma, motion_score
from video_assets.core.vocabulary import CURATION_BLURRY, CURATION_DARK, CURATION_FLAT

SCREEN_FROZEN = "frozen"  # the same picture as the frame given before it


@dataclass(frozen=True)
class ScreenConfig:
    """Thresholds in 0-255 luma units, on one pixel in 4 x 4 of the frame as the model sees it. 0 turns a test
    off (``lookahead_frames`` 0: nothing is replaced)."""

    dark_max_brightness: float = 12.0  # mean luma under this: black (the corpus's darkest real scene: 19.9)
    flat_max_contrast: float = 2.0  # luma standard deviation under this: blank (a plane in a grey sky: 5.1)
    blur_max_sharpness: float = 1.0  # Laplacian variance under this: no detail at all (corpus minimum: 8.6)
    # Mean absolute difference to the frame given before it under this: a frozen repeat. The corpus's
    # stillest scene differs by 0.02 (sensor noise); a repeated picture through H.264 (crf 18) by 0.006.
    freeze_max_motion: float = 0.01
    lookahead_frames: int = 4  # decoded frames looked at after a flagged one, never past the next target

    def __post_init__(self):
        values = (self.dark_max_brightness, self.flat_max_contrast, self.blur_max_sharpness, self.freeze_max_motion)
        if min(values) < 0 or self.lookahead_frames < 0:
            raise ValueError("screening thresholds and lookahead_frames must be >= 0")


def screen_grey(rgb: np.ndarray) -> np.ndarray:
    """The luma the scores are computed on: one pixel in 4 x 4 of an (H, W, 3) RGB frame."""
    return luma(rgb[::4, ::4])


def useless(grey: np.ndarray, prev: np.ndarray | None, cfg: ScreenConfig) -> str:
    """Why a frame (``screen_grey``) carries no picture worth a model's tokens, or "" when it does; ``prev``:
    the grey of the frame given before it (None for the first)."""
    if grey.size == 0:
        return ""
    if float(grey.mean()) < cfg.dark_max_brightness:
        return CURATION_DARK
    if float(grey.std()) < cfg.flat_max_contrast:
        return CURATION_FLAT
    if laplacian_variance(grey) < cfg.blur_max_sharpness:
        return CURATION_BLURRY
    if prev is not None and prev.shape == grey.shape and motion_score(prev, grey) < cfg.freeze_max_motion:
        return SCREEN_FROZEN
    return ""


class Screener:
    """One video's screening state: the grey of the last frame given (for ``frozen``), and what was screened,
    by target index: ``{index: {"reason", "from_s", "to_s"}}`` (``to_s`` None: flagged, no useful frame
    near, kept as it was). A redo of the same targets overwrites their entries."""

    def __init__(self, cfg: ScreenConfig):
        self.cfg = cfg
        self.prev: np.ndarray | None = None
        self.screened: dict[int, dict] = {}

    def check(self, rgb: np.ndarray) -> tuple[str, np.ndarray]:
        grey = screen_grey(rgb)
        return useless(grey, self.prev, self.cfg), grey

    def given(self, index: int, grey: np.ndarray | None, reason: str = "", from_s: float = 0.0, to_s=None) -> None:
        """The frame for target ``index`` was given (``grey``: its screen_grey, None when not screened)."""
        if grey is not None:
            self.prev = grey
        if reason:
            self.screened[index] = {"reason": reason, "from_s": round(from_s, 6), "to_s": to_s}
        else:
            self.screened.pop(index, None)
