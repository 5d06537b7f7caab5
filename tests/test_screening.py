"""Frames screened before the engine (core.media.screening): a black or frozen sampled frame gives way to the
nearest useful frame decoded after it, never past the next target; nothing is dropped; a clip dark all
through is sampled as before. Clips generated here with PyAV (the corpus has no black flash)."""

import numpy as np
import pytest

from tests.fixtures.generated_clips import write_clip_with_black_frames
from video_assets.core.media.sampling import SamplingConfig, sample_video
from video_assets.core.media.screening import SCREEN_FROZEN, ScreenConfig, screen_grey, useless

# 10 fps, 100 frames: targets at 0.5, 1.5, ... 9.5 s, i.e. frames 5, 15, ..., 95.
PLAIN = SamplingConfig(max_frames=10, screen=None)
SCREENED = SamplingConfig(max_frames=10)


def _frames_at(video, times):
    seg = video.segments[0]
    return [seg.frames[seg.timestamps.index(t)] for t in times]


def test_a_black_frame_gives_way_to_the_next_useful_one_and_the_rest_are_untouched(tmp_path):
    # Frame 5 black (one flash), 25 and 26 black (two), 95-99 black (the clip ends dark).
    clip = write_clip_with_black_frames(tmp_path / "flash.mp4", black={5, 25, 26, *range(95, 100)})
    plain, screened = sample_video(clip, PLAIN), sample_video(clip, SCREENED)
    p, s = plain.segments[0], screened.segments[0]
    assert len(s.timestamps) == len(p.timestamps) == 10  # nothing dropped
    assert s.timestamps == pytest.approx([0.6, 1.5, 2.7, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5])
    assert s.screened == [
        {"frame": 0, "reason": "dark", "from_s": 0.5, "to_s": 0.6},
        {"frame": 2, "reason": "dark", "from_s": 2.5, "to_s": 2.7},
        # No useful frame before the stream ends: flagged and kept as it was.
        {"frame": 9, "reason": "dark", "from_s": 9.5, "to_s": None},
    ]
    assert screened.decode_stats["frames_screened"] == 2
    assert p.frames[0].mean() < 5 and s.frames[0].mean() > 100
    # Every frame not replaced is the very frame the plain plan returns (bit for bit).
    same = [j for j in range(10) if j not in (0, 2)]
    assert all(np.array_equal(p.frames[j], s.frames[j]) for j in same)


def test_a_replacement_never_takes_the_next_targets_frame(tmp_path):
    # Frames 5-14 black: the frames after the target at 0.5 s stay black up to the next target (1.5 s).
    clip = write_clip_with_black_frames(tmp_path / "long_black.mp4", black=set(range(5, 15)))
    far = sample_video(clip, SamplingConfig(max_frames=10, screen=ScreenConfig(lookahead_frames=50))).segments[0]
    assert far.timestamps[:2] == pytest.approx([0.5, 1.5])
    assert far.screened == [{"frame": 0, "reason": "dark", "from_s": 0.5, "to_s": None}]


def test_a_clip_dark_all_through_is_sampled_as_without_screening(tmp_path):
    clip = write_clip_with_black_frames(tmp_path / "night.mp4", black=set(range(100)))
    plain, screened = sample_video(clip, PLAIN).segments[0], sample_video(clip, SCREENED).segments[0]
    assert screened.timestamps == plain.timestamps and np.array_equal(screened.frames, plain.frames)
    assert [s["to_s"] for s in screened.screened] == [None] * 10


def test_a_frozen_repeat_gives_way_to_the_first_frame_that_moves(tmp_path):
    # Frames 6-16 repeat frame 5: the target at 1.5 s (frame 15) shows the picture given at 0.5 s.
    clip = write_clip_with_black_frames(tmp_path / "frozen.mp4", black=set(), frozen=set(range(6, 17)))
    seg = sample_video(clip, SCREENED).segments[0]
    assert seg.screened == [{"frame": 1, "reason": SCREEN_FROZEN, "from_s": 1.5, "to_s": 1.7}]
    # Off, the plain plan (and nothing recorded).
    assert sample_video(clip, SamplingConfig(max_frames=10, screen=None)).segments[0].screened == []


def test_the_thresholds_leave_real_dim_blank_and_still_pictures_alone():
    rng = np.random.default_rng(3)
    cfg = ScreenConfig()
    night = rng.normal(20, 6, (252, 448, 3)).clip(0, 255).astype(np.uint8)  # a dim scene, noise and all
    sky = np.full((252, 448, 3), 180, np.uint8)
    sky[120:126, 200:230] = 250  # a grey sky with a plane in it
    assert useless(screen_grey(night), None, cfg) == ""
    assert useless(screen_grey(sky), None, cfg) == ""
    assert useless(screen_grey(np.zeros_like(sky)), None, cfg) == "dark"
    assert useless(screen_grey(np.full_like(sky, 128)), None, cfg) == "flat"
    # The same dim scene with its noise redrawn is still (not frozen); the identical picture is frozen.
    again = rng.normal(20, 6, (252, 448, 3)).clip(0, 255).astype(np.uint8)
    assert useless(screen_grey(again), screen_grey(night), cfg) == ""
    assert useless(screen_grey(night), screen_grey(night), cfg) == SCREEN_FROZEN
    with pytest.raises(ValueError):
        ScreenConfig(lookahead_frames=-1)
