"""Frame sampling: pure planning, then sparse decoding checked against full decodes of the sample corpus."""

import csv
import functools
import os

import av
import numpy as np
import pytest
from PIL import Image

from tests.fixtures.generated_clips import write_gop_clip
from tests.fixtures.samples import MANIFEST, clip, corpus, corpus_params
from video_assets.core.media import sampling
from video_assets.core.media.sampling import (
    SamplingConfig,
    SamplingError,
    _index_keyframes,
    _Reformatters,
    apply_rotation,
    densify_around_motion,
    fit_to_budget,
    plan_seeks,
    plan_timestamps,
    sample_video,
    scene_boundaries,
    segment_ranges,
    snap_to_keyframes,
    to_rgb,
)

CFG = SamplingConfig()
NO_DENSIFY = SamplingConfig(motion_densify=False)
LONG = "one-by-one-person-detection.mp4"


def manifest() -> dict[str, dict]:
    return {r["file"]: r for r in csv.DictReader(MANIFEST.open())} if MANIFEST.exists() else {}


ROWS = manifest()


def sampled(name: str, cfg: SamplingConfig = CFG):
    # The clip is looked up outside the cache, so the samples guard sees every test that asks.
    return _sampled(str(clip(name)), cfg)  # one cache key whether or not cfg is passed


@functools.cache
def _sampled(path: str, cfg: SamplingConfig):
    return sample_video(path, cfg)


def frame_times(name: str) -> tuple[float, ...]:
    """Presentation times of every frame, relative to the stream start, from demuxing alone."""
    return _frame_times(str(clip(name)))


@functools.cache
def _frame_times(path: str) -> tuple[float, ...]:
    with av.open(path) as c:
        s = c.streams.video[0]
        t0 = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        return tuple(sorted(float(p.pts * s.time_base) - t0 for p in c.demux(s) if p.pts is not None))


def full_decode(name: str, times: list[float]) -> dict[float, av.VideoFrame]:
    """Frames at the given relative times from a plain decode of the whole file (no seeking)."""
    wanted, out = {round(t, 6) for t in times}, {}
    with av.open(str(clip(name))) as c:
        s = c.streams.video[0]
        t0 = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        for frame in c.decode(s):
            key = round(frame.time - t0, 6)
            if key in wanted:
                out[key] = frame
    return out


def first_at_or_after(times, targets) -> list[float]:
    """The documented pick rule, computed independently: first unused frame time >= each target."""
    picks, i = [], 0
    for target in targets:
        while i < len(times) and (times[i] < target or (picks and times[i] <= picks[-1])):
            i += 1
        if i == len(times):
            break
        picks.append(times[i])
    return picks


def budget_size(row) -> tuple[int, int]:
    w, h = map(int, row["resolution"].split("x"))
    if int(row["rotation"]) % 180:
        w, h = h, w
    return fit_to_budget(w, h, CFG)


# ---------------------------------------------------------------- pure planning


def test_plan_timestamps_floor_cap_and_centring():
    short = plan_timestamps(1.57, CFG)
    assert len(short) == 8 and short[0] == pytest.approx(1.57 / 16) and short[-1] == pytest.approx(1.57 * 15 / 16)
    assert plan_timestamps(10.0, CFG) == pytest.approx([0.5 + i for i in range(10)])
    assert len(plan_timestamps(139.4, CFG)) == 32
    shifted = plan_timestamps(10.0, CFG, start_s=20.0)
    assert shifted[0] == pytest.approx(20.5) and shifted[-1] < 30.0
    assert plan_timestamps(0.0, CFG) == []
    assert len(plan_timestamps(4.0, SamplingConfig(fps=4.0))) == 16


def test_plan_seeks_groups_targets_by_preceding_keyframe():
    groups = plan_seeks([0.5, 1.5, 2.5, 9.0, 9.5], [0.0, 2.0, 8.0])
    assert groups == [(0.0, [0.5, 1.5]), (2.0, [2.5]), (8.0, [9.0, 9.5])]
    assert plan_seeks([0.1, 5.0], []) == [(0.0, [0.1, 5.0])]  # no index: one forward decode
    assert plan_seeks([0.01], [0.04, 1.0]) == [(0.04, [0.01])]  # before the first keyframe
    assert plan_seeks([3.0, 1.0], [0.0, 2.0]) == [(0.0, [1.0]), (2.0, [3.0])]  # unsorted input


def test_densify_spends_samples_near_peaks_within_the_cap():
    base = plan_timestamps(100.0, CFG)
    motion = [(float(t), 0.9 if 50 <= t <= 52 else 0.01) for t in range(0, 101)]
    dense = densify_around_motion(base, motion, CFG, 100.0)
    assert len(dense) <= CFG.max_frames and dense == sorted(set(dense))
    assert all(0 <= t < 100 for t in dense)
    near = lambda ts: sum(49 <= t <= 52 for t in ts)  # noqa: E731 - the peak interval incl. the change
    assert near(dense) >= near(base) + 8
    assert max(np.diff([0.0, *dense, 100.0])) < 100 / (CFG.max_frames * 0.5) + 1e-6  # half stays uniform
    assert densify_around_motion(base, [(float(t), 0.05) for t in range(100)], CFG, 100.0) == base  # flat
    assert densify_around_motion(base, [], CFG, 100.0) == base
    few = plan_timestamps(100.0, SamplingConfig(fps=0.1))
    assert len(densify_around_motion(few, motion, CFG, 100.0)) == 2 * len(few)  # adds, still capped


def test_scene_boundaries_threshold_and_gap():
    motion = [(t / 10, 0.01) for t in range(100)]
    motion[30] = (3.0, 0.5)
    motion[35] = (3.5, 0.3)  # too close to the cut at 3.0: the stronger wins
    motion[70] = (7.0, 0.4)
    assert scene_boundaries(motion) == [3.0, 7.0]
    assert scene_boundaries(motion, threshold=0.45) == [3.0]
    assert scene_boundaries(motion, min_gap_s=0.1) == [3.0, 3.5, 7.0]
    busy = [(t / 10, 0.3 + 0.05 * (t % 2)) for t in range(100)]  # fast steady motion, no cut
    assert scene_boundaries(busy) == []
    assert scene_boundaries([]) == [] and scene_boundaries([(0.0, 1.0)]) == []


SIZES = [(1280, 720), (720, 1280), (176, 144), (640, 272), (4000, 30), (30, 4000), (20, 20), (7680, 4320)]


@pytest.mark.parametrize("size", SIZES)
def test_fit_to_budget(size):
    w, h = fit_to_budget(*size, CFG)
    assert w % 28 == 0 and h % 28 == 0
    assert CFG.min_pixels <= w * h <= CFG.max_pixels
    if max(size) / min(size) < 10:  # aspect kept to within rounding
        assert w / h == pytest.approx(size[0] / size[1], rel=0.2)
    assert (w >= h) == (size[0] >= size[1])


def test_fit_to_budget_does_not_upscale_small_frames_beyond_rounding():
    assert fit_to_budget(176, 144, CFG) == (168, 140)
    assert fit_to_budget(1280, 720, CFG) == (588, 336)


def test_config_rejects_impossible_budgets():
    with pytest.raises(ValueError):
        SamplingConfig(min_frames=40, max_frames=32)
    with pytest.raises(ValueError):
        SamplingConfig(max_pixels=100)


def test_segment_ranges_cover_and_merge_short_tails():
    assert segment_ranges(10.2, 5.0) == [(0.0, 5.0), (5.0, 10.2)]  # 0.2 s tail merged
    assert segment_ranges(12.0, 5.0) == [(0.0, 5.0), (5.0, 10.0), (10.0, 12.0)]
    assert segment_ranges(10.0, None, [3.0, 3.2, 9.9]) == [(0.0, 3.0), (3.0, 10.0)]
    assert segment_ranges(10.0, None) == [(0.0, 10.0)]


@pytest.mark.parametrize(
    "rotation,turned", [(90, "ccw"), (-90, "cw"), (270, "cw"), (180, "half"), (-180, "half"), (0, None)]
)
def test_apply_rotation_direction(rotation, turned):
    img = np.zeros((2, 3, 3), np.uint8)
    img[0, 0] = 255  # top-left marker in a landscape frame
    out = apply_rotation(img, rotation)
    expected = {"ccw": (3, 2, (2, 0)), "cw": (3, 2, (0, 1)), "half": (2, 3, (1, 2)), None: (2, 3, (0, 0))}[turned]
    assert out.shape[:2] == expected[:2]
    assert tuple(np.argwhere(out[..., 0] == 255)[0]) == expected[2]


# ---------------------------------------------------------------- synthetic clips


def write_clip(path, frames: int, size=(64, 48), rate=10, rotation: int | None = None, cut_at: int | None = None):
    with av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=rate)
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i in range(frames):
            img = np.full((size[1], size[0], 3), 40 if cut_at is None or i < cut_at else 220, np.uint8)
            img[: size[1] // 2, : size[0] // 2] = 255 - img[0, 0]  # a marked top-left quadrant
            img[-4:, (i * 3) % size[0]] = 128  # a moving bar so frames differ
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return str(path)


def test_tiny_clip_returns_every_frame_under_the_floor(tmp_path):
    clip = write_clip(tmp_path / "tiny.mp4", frames=5)
    seg = sample_video(clip, CFG).segments[0]
    assert len(seg.timestamps) == 5  # fewer than min_frames only because the clip has 5 frames
    assert seg.timestamps == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("rotation", [90, -90, 180])
def test_display_rotation_is_applied_and_sides_swap_before_budgeting(tmp_path, rotation):
    clip = write_clip(tmp_path / f"rot{rotation}.mp4", frames=10, size=(112, 56), rotation=rotation)
    result = sample_video(clip, CFG)
    frame = result.segments[0].frames[0]
    assert result.rotation == rotation if rotation != 180 else abs(result.rotation) == 180
    assert frame.shape == ((112, 56, 3) if rotation % 180 else (56, 112, 3))
    # The marked quadrant (stored top-left) after a counter-clockwise turn by `rotation` degrees.
    h, w = frame.shape[:2]
    corner = {90: (h * 3 // 4, w // 4), -90: (h // 4, w * 3 // 4), 180: (h * 3 // 4, w * 3 // 4)}[rotation]
    assert frame[corner][0] > 200 and frame[h - 1 - corner[0], w - 1 - corner[1]][0] < 80


def test_rotation_argument_overrides_the_file(tmp_path):
    clip = write_clip(tmp_path / "plain.mp4", frames=10, size=(112, 56))
    assert sample_video(clip, CFG, rotation=90).segments[0].frames.shape[1:] == (112, 56, 3)


def test_scene_split_finds_a_synthetic_cut(tmp_path):
    clip = write_clip(tmp_path / "cut.mp4", frames=60, cut_at=27)  # cut at 2.7 s of 6 s
    result = sample_video(clip, SamplingConfig(scene_split=True))
    assert [round(s.start_s, 2) for s in result.segments] == [0.0, 2.7]
    assert result.segments[1].timestamps[0] >= 2.7 and result.segments[0].timestamps[-1] < 2.7


@pytest.mark.parametrize(
    "payload", [b"", os.urandom(200_000), b"this is not a video\n" * 100], ids=["empty", "random", "text"]
)
def test_garbage_raises_sampling_error_with_a_reason(tmp_path, payload):
    path = tmp_path / "bad.mp4"
    path.write_bytes(payload)
    with pytest.raises(SamplingError) as err:
        sample_video(str(path), CFG)
    assert len(str(err.value)) > 10


def test_missing_file_and_audio_only_raise_sampling_error(tmp_path):
    with pytest.raises(SamplingError, match="cannot open"):
        sample_video(str(tmp_path / "nope.mp4"), CFG)
    wav = tmp_path / "tone.wav"
    with av.open(str(wav), "w") as out:
        s = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in [*s.encode(frame), *s.encode()]:
            out.mux(p)
    with pytest.raises(SamplingError, match="no video stream"):
        sample_video(str(wav), CFG)


# ---------------------------------------------------------------- the sample corpus


@corpus
@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_sample_respects_floor_cap_timing_and_size(name):
    row, result = ROWS[name], sampled(name)
    times = frame_times(name)
    assert len(result.segments) == 1
    seg = result.segments[0]
    n = len(seg.timestamps)
    assert min(CFG.min_frames, len(times)) <= n <= CFG.max_frames
    assert all(b > a for a, b in zip(seg.timestamps, seg.timestamps[1:]))
    one_frame = 1.0 / float(row["fps"].split("avg=")[-1])
    assert 0.0 <= seg.timestamps[0] and seg.timestamps[-1] <= result.duration_s + one_frame
    w, h = budget_size(row)
    assert seg.frames.dtype == np.uint8 and seg.frames.shape == (n, h, w, 3)
    assert result.rotation == int(row["rotation"])
    assert result.decode_stats["late_seeks"] == 0 or name == "cityCC0.mpg"  # MPEG-PS seeks by byte search


@corpus
@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_sample_picks_the_first_frame_at_or_after_each_target(name):
    cfg = CFG if float(ROWS[name]["duration_s"]) <= CFG.long_video_s else NO_DENSIFY
    result = sampled(name, cfg)
    targets = plan_timestamps(result.duration_s, cfg)
    assert result.segments[0].timestamps == pytest.approx(first_at_or_after(frame_times(name), targets), abs=1e-9)


@pytest.mark.parametrize(
    "name", corpus_params(["cockatoo.mp4", "cityCC0.mpg", "bikes.mp4", "tree.avi", "no_duration.webm", LONG])
)
def test_sparse_frames_equal_the_same_frames_from_a_full_decode(name):
    """Seeking must not change pixels (cockatoo and MPEG-2 give corrupt frames after a careless seek)."""
    result = sampled(name, NO_DENSIFY)
    seg = result.segments[0]
    h, w = seg.frames.shape[1:3]
    reference = full_decode(name, seg.timestamps)
    assert len(reference) == len(seg.timestamps)
    for t, got in zip(seg.timestamps, seg.frames):
        ref = to_rgb(reference[round(t, 6)], w, h)
        assert np.abs(ref.astype(int) - got).mean() < 0.5, t


@corpus
def test_one_set_of_swscale_contexts_converts_a_mix_of_frames_as_fresh_ones_do():
    """The sampler keeps its swscale contexts across frames (_Reformatters); frames of other sizes and
    pixel formats in between (YUV scaled in YUV, cinepak's RGB in one step) must not change a pixel."""
    frames = []
    for name in ("bikes.mp4", "tree.avi", "cockatoo.mp4"):
        with av.open(str(clip(name))) as c:
            frames += [f for _, f in zip(range(3), c.decode(video=0))]
    assert len({(f.width, f.height, f.format.name) for f in frames}) >= 2
    shared = _Reformatters()
    for size in ((224, 126), (160, 96)):
        for f in frames:
            fresh = to_rgb(f, *size)
            assert fresh.shape == (size[1], size[0], 3)
            assert np.array_equal(to_rgb(f, *size, shared), fresh)


@pytest.mark.parametrize("name", corpus_params([LONG, "cockatoo.mp4", "bikes.mp4", "asl_eat.mkv", "tree.avi"]))
def test_index_keyframes_are_presentation_times(name):
    """mp4 indexes decode times (B-frames: earlier than presentation); seeks are planned on presentation times."""
    with av.open(str(clip(name))) as c:
        s = c.streams.video[0]
        t0 = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        from_index = _index_keyframes(c, s, t0)
        keys = sorted(float(p.pts * s.time_base) - t0 for p in c.demux(s) if p.pts is not None and p.is_keyframe)
    assert from_index == [] if len(keys) < 2 else from_index == pytest.approx(keys, abs=1e-6)


def test_fire2_uses_real_presentation_times_and_turns_the_picture():
    result = sampled("fire2.mp4")
    seg = result.segments[0]
    times = frame_times("fire2.mp4")
    gaps = np.diff(times)
    assert gaps.max() > 1.2 * gaps.min()  # really variable frame rate (0.08 to 0.1 s)
    assert set(round(t, 6) for t in seg.timestamps) <= set(round(t, 6) for t in times)
    uniform_grid = [i / 10.505 for i in range(len(times))]
    assert any(min(abs(t - g) for g in uniform_grid) > 0.005 for t in seg.timestamps)  # not a 1/fps guess
    assert result.rotation == -180 and seg.frames.shape[1:] == (336, 588, 3)
    reference = full_decode("fire2.mp4", seg.timestamps)
    for t, got in zip(seg.timestamps, seg.frames):
        full = reference[round(t, 6)].to_ndarray(format="rgb24")  # stored orientation, full size
        turned = np.asarray(Image.fromarray(full[::-1, ::-1]).resize((588, 336), Image.BICUBIC), dtype=int)
        unturned = np.asarray(Image.fromarray(full).resize((588, 336), Image.BICUBIC), dtype=int)
        err, wrong = np.abs(turned - got).mean(), np.abs(unturned - got).mean()
        assert err < 4 and wrong > 3 * err, (t, err, wrong)


def test_webm_without_duration_is_estimated_and_sampled():
    result = sampled("no_duration.webm")
    assert result.decode_stats["duration_estimated"] is True
    assert result.duration_s == pytest.approx(74 / 14.985, rel=0.05)
    seg = result.segments[0]
    assert len(seg.timestamps) == CFG.min_frames and seg.timestamps[-1] <= result.duration_s


@corpus
def test_long_clip_decodes_far_fewer_frames_than_a_full_decode():
    total = len(frame_times(LONG))
    assert total == 1394
    for cfg in (CFG, NO_DENSIFY):  # with and without the keyframe-only motion pass
        stats = sampled(LONG, cfg).decode_stats
        assert stats["frames_decoded"] < total / 2, stats
    assert sampled(LONG).decode_stats["keyframe_only"] is True


@corpus
def test_motion_densification_changes_the_long_plan_only_within_the_cap():
    dense, uniform = sampled(LONG).segments[0], sampled(LONG, NO_DENSIFY).segments[0]
    assert len(uniform.timestamps) == CFG.max_frames
    assert len(dense.timestamps) <= CFG.max_frames
    assert dense.timestamps != uniform.timestamps
    assert all(0 <= t <= 139.4 for t in dense.timestamps)
    # People enter around 7-9 s, 19-26 s, 44-46 s ...; the empty room 100-117 s gets fewer samples.
    assert sum(100 <= t <= 117 for t in dense.timestamps) < sum(100 <= t <= 117 for t in uniform.timestamps)


def test_fixed_segments_cover_the_duration_with_their_own_ranges():
    cfg = SamplingConfig(segment_s=10.0)
    result = sampled("bottle-detection.mp4", cfg)
    segs = result.segments
    assert [s.index for s in segs] == [0, 1, 2, 3]
    assert segs[0].start_s == 0.0 and segs[-1].end_s == pytest.approx(result.duration_s)
    assert all(a.end_s == b.start_s for a, b in zip(segs, segs[1:]))
    times = frame_times("bottle-detection.mp4")
    for seg in segs:
        in_range = sum(seg.start_s <= t < seg.end_s for t in times)
        assert min(cfg.min_frames, in_range) <= len(seg.timestamps) <= cfg.max_frames
        assert all(seg.start_s <= t < seg.end_s + 0.04 for t in seg.timestamps)
        assert len(seg.timestamps) == pytest.approx(cfg.fps * (seg.end_s - seg.start_s), abs=1)
    everything = [t for s in segs for t in s.timestamps]
    assert everything == sorted(set(everything))


def test_short_segments_keep_the_floor_of_what_they_contain():
    cfg = SamplingConfig(segment_s=0.5)
    result = sampled("realshort.mp4", cfg)
    times = frame_times("realshort.mp4")
    assert len(result.segments) == 3
    for seg in result.segments:
        in_range = sum(seg.start_s <= t < seg.end_s for t in times)
        assert len(seg.timestamps) >= min(cfg.min_frames, in_range)
        assert all(seg.start_s <= t for t in seg.timestamps)


@pytest.mark.parametrize(
    "name,cuts",
    [
        pytest.param("bikes.mp4", [1.2, 3.04, 5.48, 7.48], marks=corpus),
        pytest.param("cityCC0.mpg", [4.64], marks=corpus),
        ("realshort.mp4", []),
    ],
)
def test_scene_split_on_real_cuts(name, cuts):
    result = sampled(name, SamplingConfig(scene_split=True))
    assert [s.start_s for s in result.segments[1:]] == pytest.approx(cuts, abs=0.05)
    for seg in result.segments:
        assert len(seg.timestamps) >= CFG.min_frames
        assert seg.timestamps[0] >= seg.start_s


# ---------------------------------------------------------------- skipping and keyframe snapping


def generated_times(path: str, keyframes: bool = False) -> list[float]:
    with av.open(path) as c:
        s = c.streams.video[0]
        t0 = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        return sorted(
            float(p.pts * s.time_base) - t0
            for p in c.demux(s)
            if p.pts is not None and (p.is_keyframe or not keyframes)
        )


def decode_all(path: str) -> dict[float, av.VideoFrame]:
    with av.open(path) as c:
        s = c.streams.video[0]
        t0 = float(s.start_time * s.time_base) if s.start_time is not None else 0.0
        return {round(f.time - t0, 6): f for f in c.decode(s)}


def assert_frames_match_full_decode(path: str, seg) -> None:
    h, w = seg.frames.shape[1:3]
    reference = decode_all(path)
    for t, got in zip(seg.timestamps, seg.frames):
        ref = to_rgb(reference[round(t, 6)], w, h)
        assert np.array_equal(ref, got), t  # bit-identical: nothing a kept frame refers to was skipped


@pytest.mark.parametrize("codec,threads", [("libx264", 1), ("libx264", 0), ("mpeg4", 1)])
def test_exact_frames_on_a_long_gop_clip_with_skipping_equal_a_full_decode(tmp_path, codec, threads):
    path = write_gop_clip(tmp_path / f"long_gop_{codec}.mp4", codec, frames=500, gop=500)  # one keyframe, 20 s
    cfg = SamplingConfig(motion_densify=False, decode_threads=threads)
    result = sample_video(path, cfg)
    seg, stats = result.segments[0], result.decode_stats
    times = generated_times(path)
    assert len(generated_times(path, keyframes=True)) == 1
    assert seg.timestamps == pytest.approx(first_at_or_after(times, plan_timestamps(result.duration_s, cfg)), abs=1e-9)
    assert_frames_match_full_decode(path, seg)
    needed = sum(t <= seg.timestamps[-1] for t in times)  # without skipping: every frame up to the last pick
    assert stats["frames_decoded"] < 0.8 * needed, stats  # the B-frames between targets were skipped
    assert stats["regated"] is False


def test_snapping_on_an_avi_with_b_frames_lands_on_the_real_keyframes(tmp_path, monkeypatch):
    # MPEG-4 ASP in AVI, one B-frame between references: AVI's index counts frames in decode order, so an
    # I-frame shows a frame or two after its index time. Taken as display times, one snapped target landed
    # on a B-frame decoded without its references (a wrong picture).
    path = write_gop_clip(tmp_path / "asp.avi", "mpeg4", frames=300, gop=30, size=(320, 240), bframes=1)
    cfg = SamplingConfig(keyframe_snap_s=1.0, min_frames=12, max_frames=12)
    keys = generated_times(path, keyframes=True)
    result = sample_video(path, cfg)
    seg = result.segments[0]
    assert_frames_match_full_decode(path, seg)
    snapped = [t for t in seg.timestamps if any(abs(t - k) < 1e-6 for k in keys)]
    assert len(snapped) == result.decode_stats["snapped"] >= 9
    # With the index's times taken as display times (as before), a picture is wrong.
    monkeypatch.setattr(sampling, "DECODE_TIME_INDEX", ("mp4",))
    with pytest.raises(AssertionError):
        assert_frames_match_full_decode(path, sample_video(path, cfg).segments[0])


def test_a_clip_shorter_than_the_frame_floor_is_decoded_once(tmp_path, monkeypatch):
    path = write_gop_clip(tmp_path / "short.mp4", "mpeg4", frames=10, gop=250, rate=10)  # 1 s, B-frames
    result = sample_video(path, CFG)
    # Targets every 0.125 s from 0.0625: the first 7 take 0.1 ... 0.9; the last (0.9375) is past the end,
    # so the latest unused frame fills in: 0.8, a B-frame a skipping pass would have dropped.
    want = pytest.approx([0.1, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9], abs=1e-9)
    assert result.segments[0].timestamps == want
    # Ten frames for eight targets: nothing is skipped, so the fill-in is there and no frame decodes twice.
    assert result.decode_stats["regated"] is False and result.decode_stats["frames_decoded"] <= 10
    assert_frames_match_full_decode(path, result.segments[0])
    # Where skipping went ahead and the fill-in needed a skipped frame, the collection is redone without
    # skipping: the same frames, at twice the decoding.
    monkeypatch.setattr(sampling, "worth_skipping", lambda *a: True)
    again = sample_video(path, CFG)
    assert again.decode_stats["regated"] is True and again.segments[0].timestamps == want
    assert again.decode_stats["frames_decoded"] > 10
    assert_frames_match_full_decode(path, again.segments[0])


def test_snap_to_keyframes_moves_within_tolerance_keeps_order_and_uses_each_keyframe_once():
    keys = [0.0, 2.0, 4.0, 6.0, 8.0]
    targets, snapped = snap_to_keyframes([0.4, 1.8, 2.5, 5.0, 9.9], keys, 0.6)
    assert targets == [0.0, 2.0, 2.5, 5.0, 9.9]  # 2.5: 2.0 is taken; 5.0: both keyframes too far
    assert snapped == [True, True, False, False, False]
    assert snap_to_keyframes([5.0], keys, 1.0) == ([4.0], [True])  # the nearer of two, the earlier on a tie
    assert snap_to_keyframes([3.9], keys, 1.0, lo=4.0 + 1e-9) == ([3.9], [False])  # not outside its segment
    # 1.1: 0.0 is taken and 2.0 lies past the next target (1.2), so it stays exact
    assert snap_to_keyframes([1.0, 1.1, 1.2], keys, 5.0) == ([0.0, 1.1, 2.0], [True, False, True])
    assert snap_to_keyframes([1.0], keys, 0.0) == ([1.0], [False])


def test_keyframe_snapping_returns_keyframes_at_their_real_times(tmp_path):
    path = write_gop_clip(tmp_path / "gop.mp4", "libx264", frames=400, gop=12)  # 16 s, a keyframe every 0.48 s
    cfg = SamplingConfig(motion_densify=False, keyframe_snap_s=0.3)
    result = sample_video(path, cfg)
    seg, stats = result.segments[0], result.decode_stats
    keys, times = generated_times(path, keyframes=True), generated_times(path)
    plan = plan_timestamps(result.duration_s, cfg)
    assert len(seg.timestamps) == len(plan) == 16
    assert stats["snapped"] == 16
    for target, t in zip(plan, seg.timestamps):
        assert abs(t - target) <= 0.3
        assert min(abs(t - k) for k in keys) < 1e-9  # a keyframe, reported at its own presentation time
        assert min(abs(t - f) for f in times) < 1e-9
    assert_frames_match_full_decode(path, seg)
    # Keyframes only: no reference chains, and each run drains its keyframe instead of decoding on to the
    # next keyframe (which the decoder needs before it lets a held-back keyframe out).
    assert stats["packets_decoded"] <= len(seg.timestamps) + 2, stats
    exact = sample_video(path, SamplingConfig(motion_densify=False))
    assert exact.segments[0].timestamps != seg.timestamps  # snapping really moved targets


def test_snapping_returns_real_keyframes_where_the_mp4_index_holds_decode_times(tmp_path):
    # HEVC with B-frames in mp4: the index holds decode times, and the delay to presentation time is not
    # constant (0.08 s on the first keyframe, more after), so snapped targets come from a packet scan.
    if "libx265" not in av.codecs_available:
        pytest.skip("PyAV without libx265")
    path = str(tmp_path / "hevc.mp4")
    with av.open(path, "w") as out:
        s = out.add_stream("libx265", rate=25, options={"x265-params": "log-level=error:keyint=25:min-keyint=25"})
        s.width, s.height, s.pix_fmt = 160, 96, "yuv420p"
        rng = np.random.default_rng(3)
        texture = rng.integers(0, 255, (104, 480, 3), dtype=np.uint8)
        for i in range(250):
            img = np.ascontiguousarray(texture[4:100, 2 * i % 320 : 2 * i % 320 + 160])
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    keys = generated_times(path, keyframes=True)
    assert len(keys) == 10
    result = sample_video(path, SamplingConfig(motion_densify=False, keyframe_snap_s=0.5))
    seg, stats = result.segments[0], result.decode_stats
    assert stats["snapped"] == 10 and stats["late_seeks"] == 0 and stats["regated"] is False, stats
    assert seg.timestamps == pytest.approx(keys, abs=1e-9)
    assert_frames_match_full_decode(path, seg)
    assert stats["packets_decoded"] <= 12, stats


def test_snapped_targets_reuse_the_keyframes_the_motion_pass_decoded(tmp_path):
    path = write_gop_clip(tmp_path / "long.mp4", "libx264", frames=500, gop=25)  # 20 s, a keyframe a second
    # A "long" video (the motion pass runs) and fewer targets than keyframes: every target snaps
    cfg = SamplingConfig(long_video_s=5.0, keyframe_snap_s=0.6, min_frames=4, max_frames=10)
    result = sample_video(path, cfg)
    seg, stats = result.segments[0], result.decode_stats
    keys = generated_times(path, keyframes=True)
    assert stats["motion"] == "keyframe_only" and stats["motion_frames_decoded"] == len(keys) == 20
    assert stats["snapped"] == stats["keyframes_reused"] == len(seg.timestamps) == 10, stats
    assert stats["seeks"] == 1 and stats["packets_decoded"] == len(keys), stats  # the motion pass alone
    assert all(min(abs(t - k) for k in keys) < 1e-9 for t in seg.timestamps)
    assert_frames_match_full_decode(path, seg)
    # A cache too small for any frame: the same frames, decoded again
    from video_assets.core.media import sampling

    small = sampling.KEYFRAME_CACHE_BYTES
    try:
        sampling.KEYFRAME_CACHE_BYTES = 0
        again = sample_video(path, cfg)
    finally:
        sampling.KEYFRAME_CACHE_BYTES = small
    assert again.decode_stats["keyframes_reused"] == 0
    assert again.segments[0].timestamps == seg.timestamps
    assert np.array_equal(again.segments[0].frames, seg.frames)


def test_keyframe_snapping_keeps_exact_frames_where_no_keyframe_is_near(tmp_path):
    path = write_gop_clip(tmp_path / "sparse.mp4", "libx264", frames=250, gop=250)  # 10 s, one keyframe
    cfg = SamplingConfig(motion_densify=False, keyframe_snap_s=0.6)
    result = sample_video(path, cfg)
    seg = result.segments[0]
    assert seg.timestamps[0] == pytest.approx(0.0)  # the target at 0.5 s moved to the keyframe at 0
    rest = plan_timestamps(result.duration_s, cfg)[1:]
    assert seg.timestamps[1:] == pytest.approx(first_at_or_after(generated_times(path), rest), abs=1e-9)
    assert_frames_match_full_decode(path, seg)


def test_match_times_finds_the_same_frame_or_none():
    from video_assets.core.media.sampling import match_times

    found = [0.0, 0.04, 0.5]
    assert match_times(found, [0.04, 0.0400004, 0.3, 0.5, 0.0, 0.6]) == [1, 1, None, 2, 0, None]
    assert match_times([], [1.0]) == [None]
