"""Choose and decode the frames a VLM sees: a timestamp plan per segment, then a sparse decode.

Planning is pure (``plan_timestamps``, ``plan_seeks``, ``densify_around_motion``,
``scene_boundaries``, ``fit_to_budget``, ``snap_to_keyframes``). ``sample_video`` decodes only what the
plan needs: it seeks to the keyframe before each group of targets, decodes forward and takes, for each
target, the first frame whose presentation time is at or after it. Between targets the decoder skips
what no target needs: non-reference frames before the next exact target (``skip_frame`` NONREF: no
other frame is predicted from them, so the frames kept are bit-identical to a full decode), and every
non-key frame before a target snapped to a keyframe (NONKEY). Decoding stops after the last target.

Keyframe snapping (``SamplingConfig.keyframe_snap_s`` > 0) lets a target move to a keyframe at most that
many seconds away; such a frame needs no reference chain, so sampling costs about a keyframe-only
decode where keyframes are dense. Timestamps always report the real time of the frame returned.

All times are seconds from the first presentation time of the video stream (``stream.start_time``),
so a clip whose stream starts at 0.54 s (MPEG-PS) still plans from 0.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from video_assets.core.media.screening import ScreenConfig, Screener
from video_assets.core.media.source import open_container
from video_assets.core.media.streams import scan_packets, scanned_duration, start_s, stored_duration

# Container formats whose index (stream.index_entries) is read from the file before decoding and
# flags real keyframes. MPEG-PS builds its index while reading and flags nearly every packet.
INDEXED_FORMATS = ("mp4", "matroska", "avi")
# Of those, the ones whose index holds decode times: a keyframe's presentation time is its decode time
# plus a reordering delay that is not constant (HEVC: 0.08 s for the first keyframe, 0.12 s after). AVI's
# index counts frames in decode order: with B-frames (MPEG-4 ASP) a keyframe shows 1-2 frames after it.
DECODE_TIME_INDEX = ("mp4", "avi")
MOTION_SIZE = (64, 36)  # low-res grey frames for motion scores: enough for cuts and big movement
MOTION_MAX_POINTS = 512  # seek-based motion fallback: at most this many keyframes are decoded
MOTION_SHARE = 0.5  # densification: share of the samples placed by motion, the rest stay uniform
DENSIFY_GRID = 2048
# Scene cuts: keyframe intervals changing more than this are decoded in full to find the cut itself.
CUT_CANDIDATE_SCORE = 0.075
CUT_SCORE = 0.15  # frame-to-frame mean absolute grey difference (of 1.0) that reads as a cut
# A snapped target is a keyframe time from the index or a packet scan; the decoded frame's time may
# differ from it by rounding, so it counts as reached this much early (frames are >= 4 ms apart).
SNAP_EPS_S = 1e-3
# Keyframes the motion pass decoded are kept, up to this many bytes of decoded pictures, so that targets
# snapped to them are not decoded a second time (a 768x432 frame is 0.5 MB, a 1080p one 3 MB).
KEYFRAME_CACHE_BYTES = 128 << 20


class SamplingError(Exception):
    """A file that yields no frame, with a readable reason."""


@dataclass(frozen=True)
class SamplingConfig:
    fps: float = 1.0
    min_frames: int = 8
    max_frames: int = 32
    motion_densify: bool = True
    long_video_s: float = 60.0
    max_pixels: int = 448 * 448
    min_pixels: int = 56 * 56
    patch_factor: int = 28
    segment_s: float | None = None
    scene_split: bool = False
    # 0: exact frames (the first frame at or after each target). > 0: a target may move to a distinct
    # keyframe at most this many seconds away within its segment (no reference chain to decode).
    keyframe_snap_s: float = 0.0
    # FFmpeg decoder threads per video. 1 suits parallel workers holding one CPU each (the Ray decode
    # stage): threading spends 15-40 % more CPU time for the same frames. 0 lets FFmpeg choose.
    decode_threads: int = 1
    # Frames screened before the engine (``media.screening``; on by default, it never drops a frame): None
    # samples exactly the planned frames.
    screen: ScreenConfig | None = ScreenConfig()

    def __post_init__(self):
        if self.fps <= 0 or self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ValueError("need fps > 0 and 1 <= min_frames <= max_frames")
        if self.patch_factor < 1 or self.max_pixels < max(self.min_pixels, self.patch_factor**2):
            raise ValueError("max_pixels must hold one patch and be >= min_pixels")
        if self.segment_s is not None and self.segment_s <= 0:
            raise ValueError("segment_s must be positive or None")
        if self.keyframe_snap_s < 0 or self.decode_threads < 0:
            raise ValueError("keyframe_snap_s and decode_threads must be >= 0")


@dataclass
class Segment:
    index: int
    start_s: float
    end_s: float
    timestamps: list[float]
    frames: np.ndarray
    # Frames screened (``media.screening``): {"frame", "reason", "from_s", "to_s"} each; to_s None: kept.
    screened: list[dict] = field(default_factory=list)


@dataclass
class SampledVideo:
    duration_s: float
    rotation: int
    segments: list[Segment]
    decode_stats: dict = field(default_factory=dict)


# ---------------------------------------------------------------- pure planning


def plan_timestamps(duration_s: float, cfg: SamplingConfig, start_s: float = 0.0) -> list[float]:
    """Uniform targets at cfg.fps in [start, start + duration), floor/cap applied, each centred in its slot."""
    if duration_s <= 0:
        return []
    n = min(cfg.max_frames, max(cfg.min_frames, int(duration_s * cfg.fps + 0.5)))
    step = duration_s / n
    return [start_s + (i + 0.5) * step for i in range(n)]


def plan_seeks(targets: list[float], keyframes: list[float]) -> list[tuple[float, list[float]]]:
    """Group sorted targets by the last keyframe at or before each one: one seek, one forward decode per group.

    A target before the first keyframe goes with the first keyframe; without keyframes everything is
    one group decoded from 0.
    """
    keys = sorted(set(keyframes)) or [0.0]
    groups: list[tuple[float, list[float]]] = []
    for target in sorted(targets):
        key = keys[max(0, bisect.bisect_right(keys, target) - 1)]
        if groups and groups[-1][0] == key:
            groups[-1][1].append(target)
        else:
            groups.append((key, [target]))
    return groups


def snap_to_keyframes(
    targets: list[float], keyframes: list[float], tolerance_s: float, lo: float = -math.inf, hi: float = math.inf
) -> tuple[list[float], list[bool]]:
    """Move each sorted target to the nearest keyframe within tolerance_s inside [lo, hi), keeping order.

    A keyframe serves at most one target and must lie after the previous result and not after the
    next original target, so the list stays sorted; a target without such a keyframe stays where it
    is. Returns the new targets and, per target, whether it moved to a keyframe.
    """
    keys = sorted(k for k in set(keyframes) if lo <= k < hi)
    out: list[float] = []
    snapped: list[bool] = []
    for i, t in enumerate(targets):
        after = out[-1] if out else -math.inf
        until = targets[i + 1] if i + 1 < len(targets) else math.inf
        j = bisect.bisect_left(keys, t)
        near = [k for k in keys[max(0, j - 1) : j + 1] if abs(k - t) <= tolerance_s and after < k <= until]
        if near and tolerance_s > 0:
            out.append(min(near, key=lambda k: abs(k - t)))
            snapped.append(True)
        else:
            out.append(t)
            snapped.append(False)
    return out, snapped


def densify_around_motion(
    base: list[float],
    motion: list[tuple[float, float]],
    cfg: SamplingConfig,
    duration_s: float,
    start_s: float = 0.0,
) -> list[float]:
    """Re-spread up to min(max_frames, 2 * len(base)) samples over [start, start + duration).

    Half of the probability mass stays uniform (coverage), half follows the motion above the median
    score (peaks). Each score measures the change since the previous motion sample, so its mass is
    spread over that interval. Flat or missing motion returns ``base`` unchanged.
    """
    end_s = start_s + duration_s
    pts = sorted((t, s) for t, s in motion if start_s <= t <= end_s)
    if len(pts) < 3 or duration_s <= 0 or not base:
        return list(base)
    times = np.array([t for t, _ in pts])
    scores = np.array([s for _, s in pts], dtype=float)
    excess = np.maximum(scores - np.median(scores), 0.0)
    excess[0] = 0.0  # the first sample has no predecessor to differ from
    if excess.sum() <= 1e-9:
        return list(base)
    edges = np.linspace(start_s, end_s, DENSIFY_GRID + 1)
    cell = np.diff(edges)
    mass = np.full(DENSIFY_GRID, (1 - MOTION_SHARE) / DENSIFY_GRID)
    for i in np.nonzero(excess)[0]:
        lo, hi = times[i - 1], max(times[i], times[i - 1] + cell[0])
        overlap = np.clip(np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo), 0, None)
        mass += MOTION_SHARE * (excess[i] / excess.sum()) * overlap / overlap.sum()
    cdf = np.concatenate([[0.0], np.cumsum(mass)])
    n = min(cfg.max_frames, 2 * len(base))
    return [float(t) for t in np.interp((np.arange(n) + 0.5) / n, cdf / cdf[-1], edges)]


def scene_boundaries(
    motion: list[tuple[float, float]], threshold: float | None = None, min_gap_s: float = 1.0
) -> list[float]:
    """Times where the frame-to-frame difference jumps (a cut), at least min_gap_s apart.

    Default threshold: CUT_SCORE, raised on busy footage to median + 6 * MAD so that steady fast
    motion does not read as a cut.
    """
    pts = sorted(motion)[1:]  # the first sample has no predecessor
    if not pts:
        return []
    if threshold is None:
        scores = np.array([s for _, s in pts])
        median = float(np.median(scores))
        threshold = max(CUT_SCORE, median + 6 * float(np.median(np.abs(scores - median))))
    cuts: list[tuple[float, float]] = []
    for t, s in pts:
        if s <= threshold:
            continue
        if cuts and t - cuts[-1][0] < min_gap_s:
            if s > cuts[-1][1]:  # keep the stronger of two cuts too close together
                cuts[-1] = (t, s)
            continue
        cuts.append((t, s))
    return [t for t, _ in cuts]


def fit_to_budget(width: int, height: int, cfg: SamplingConfig) -> tuple[int, int]:
    """Qwen2.5-VL smart_resize: sides rounded to patch_factor, scaled into [min_pixels, max_pixels]."""
    f = cfg.patch_factor
    w, h = max(f, round(width / f) * f), max(f, round(height / f) * f)
    if w * h > cfg.max_pixels:
        beta = math.sqrt(width * height / cfg.max_pixels)
        w, h = max(f, math.floor(width / beta / f) * f), max(f, math.floor(height / beta / f) * f)
    elif w * h < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (width * height))
        w, h = math.ceil(width * beta / f) * f, math.ceil(height * beta / f) * f
    # Extreme aspect ratios: a side clamped to one patch can push the other past the budget.
    if w * h > cfg.max_pixels:
        if w >= h:
            w = max(f, cfg.max_pixels // h // f * f)
        else:
            h = max(f, cfg.max_pixels // w // f * f)
    return w, h


def segment_ranges(duration_s: float, segment_s: float | None, cuts: list[float] = ()) -> list[tuple[float, float]]:
    """Split [0, duration) at multiples of segment_s and at cuts; pieces shorter than min_len are merged."""
    bounds = set(c for c in cuts if 0 < c < duration_s)
    if segment_s:
        bounds.update(k * segment_s for k in range(1, math.ceil(duration_s / segment_s)))
    min_len = min(1.0, 0.25 * segment_s) if segment_s else 1.0
    edges = [0.0]
    for b in sorted(bounds):
        if b - edges[-1] >= min_len and duration_s - b >= min_len:
            edges.append(b)
    edges.append(duration_s)
    return list(zip(edges[:-1], edges[1:]))


def rotation_turns(rotation: int) -> int:
    """Counter-clockwise quarter turns for np.rot90 (the display matrix rotates counter-clockwise)."""
    return int(round(rotation / 90)) % 4


def apply_rotation(rgb: np.ndarray, rotation: int) -> np.ndarray:
    turns = rotation_turns(rotation)
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


# ---------------------------------------------------------------- decoding


def _readable(exc: BaseException) -> str:
    return f"{exc.__class__.__name__}: {str(exc).strip() or 'no detail'}"


@dataclass
class _StreamInfo:
    t0: float  # stream start in seconds; every other time here is relative to it
    duration_s: float
    duration_estimated: bool
    keyframes: list[float]
    packets: int | None  # from a demux scan, when one ran


def _index_keyframes(container, stream, t0: float) -> list[float]:
    """Keyframe presentation times from the container index, or [] when it is absent or unreliable."""
    if not any(name in container.format.name for name in INDEXED_FORMATS):
        return []
    tb = stream.time_base
    keys = sorted(float(e.timestamp * tb) for e in stream.index_entries or [] if e.is_keyframe)
    if len(keys) < 2:
        return []
    # mp4 indexes decode times; with B-frames they trail presentation times by a constant delay,
    # visible as a first keyframe before the stream start.
    delay = max(0.0, t0 - keys[0])
    return [k + delay - t0 for k in keys]


def _stream_info(container, stream, duration_s: float | None, exact_keys: bool = False) -> _StreamInfo:
    """Stream start, duration and keyframe times. ``exact_keys``: keyframes must be presentation times
    (snapping returns them as frames), so a decode-time index gives way to a packet scan (demux only,
    about 5 us a packet)."""
    t0 = start_s(stream)
    duration, estimated = duration_s or stored_duration(container, stream), False
    decode_times = exact_keys and any(name in container.format.name for name in DECODE_TIME_INDEX)
    keys, packets = ([] if decode_times else _index_keyframes(container, stream, t0)), None
    if not duration or not keys:
        scan = scan_packets(container, stream)
        keys, packets = keys or [k - t0 for k in scan.keyframes], scan.packets
        if not duration:
            duration, estimated = scanned_duration(scan, stream), True
    if not duration:
        raise SamplingError("video stream has no duration and no timed packets")
    return _StreamInfo(t0, duration, estimated, sorted(keys), packets)


class _Gate:
    """What the decoder may skip before the target it is heading for: packets presented before
    ``before`` that are not keyframes are decoded with skip_frame ``mode`` (NONREF or NONKEY)."""

    def __init__(self):
        self.before, self.mode, self.skipping, self.drain = -math.inf, "DEFAULT", 0, False

    def aim(self, target: float, snapped: bool, last_of_run: bool = False):
        self.before, self.mode = target, "NONKEY" if snapped else "NONREF"
        # Nothing after this keyframe is needed before the next seek: skip every non-key frame, and
        # drain the decoder right after the keyframe, which it would otherwise hold back for reordering
        # until the next keyframe arrives (decoding that one too, only to be sought to again).
        self.drain = snapped and last_of_run
        if self.drain:
            self.before = math.inf


def _open_stream(container, cfg: SamplingConfig):
    stream = container.streams.video[0]
    if cfg.decode_threads == 1:
        stream.thread_type = "NONE"
    else:
        stream.thread_type, stream.thread_count = "AUTO", cfg.decode_threads
    return stream


def _decode_run(container, stream, t0: float, key: float, stats: dict, gate: _Gate | None = None):
    """Seek to the keyframe at or before `key` and yield (time, frame) forward to the end of the stream."""
    container.seek(max(0, int(round((key + t0) / stream.time_base))), stream=stream, backward=True)
    stats["seeks"] += 1
    ctx, tb = stream.codec_context, float(stream.time_base)
    mode = ctx.skip_frame  # a pass may have set its own (the motion pass: NONKEY)
    for packet in container.demux(stream):
        if gate is not None:
            # Decided per packet from its presentation time, known before decoding: only frames that
            # come before the next target in display order and that no later frame refers to go.
            skippable = packet.pts is not None and not packet.is_keyframe and packet.pts * tb - t0 < gate.before
            want = gate.mode if skippable else "DEFAULT"
            if want != mode:
                ctx.skip_frame = mode = want
            gate.skipping += want != "DEFAULT"
        stats["packets_decoded"] += mode != "NONKEY" or packet.is_keyframe  # not ruled out before decoding
        try:
            frames = packet.decode()
            if gate is not None and gate.drain and packet.is_keyframe:
                # Drained, the decoder takes no packet until flushed; flushed, it starts clean at the
                # next keyframe, as after a seek. Frames in between are skipped anyway.
                drained = ctx.decode(None)
                ctx.flush_buffers()
                for frame in drained:  # PyAV leaves drained frames without a time base
                    frame.time_base = stream.time_base
                frames = [*frames, *drained]
        except av.error.FFmpegError:  # damaged packet: the decoder usually recovers a few packets on
            stats["decode_errors"] += 1
            continue
        for frame in frames:
            stats["frames_decoded"] += 1
            if frame.pts is not None:
                yield frame.time - t0, frame


def _start_run(container, stream, info: _StreamInfo, key: float, first_target: float, stats: dict, gate=None):
    """A forward run that starts at or before first_target; steps back a keyframe when a seek lands late."""
    keys = info.keyframes
    while True:
        run = _decode_run(container, stream, info.t0, key, stats, gate)
        first = next(run, None)
        earlier = [k for k in keys if k < key]
        if first is None or first[0] <= first_target or not earlier:
            return itertools.chain([first] if first else [], run)
        stats["late_seeks"] += 1
        key = earlier[-1]


class _KeyframeCache:
    """Decoded keyframes by presentation time, kept while they fit in ``budget`` bytes."""

    def __init__(self, budget: int | None = None):
        self.left = KEYFRAME_CACHE_BYTES if budget is None else budget
        self.times, self.frames = [], []

    def keep(self, t: float, frame) -> None:
        size = sum(plane.buffer_size for plane in frame.planes)
        if size <= self.left:
            self.left -= size
            i = bisect.bisect(self.times, t)
            self.times.insert(i, t)
            self.frames.insert(i, frame)

    def get(self, t: float):
        """(time, frame) of the kept keyframe at ``t`` (a keyframe time, up to SNAP_EPS_S), or None."""
        i = bisect.bisect_left(self.times, t - SNAP_EPS_S)
        if i < len(self.times) and abs(self.times[i] - t) < SNAP_EPS_S:
            return self.times[i], self.frames[i]
        return None


def _new_stats() -> dict:
    """Decode counters. frames_decoded: frames the decoder returned, kept or not. packets_decoded: packets
    handed to it that keyframe-only skipping did not rule out; it counts the decoder's work where frames
    never come out (a keyframe it holds back when the run ends), and includes what NONREF skipping drops."""
    counters = ("frames_decoded", "packets_decoded", "motion_frames_decoded", "cut_frames_decoded", "seeks")
    return dict.fromkeys(counters, 0) | dict(
        late_seeks=0, decode_errors=0, keyframes_reused=0, frames_screened=0, motion=None, regated=False
    )


class _Regate(Exception):
    """The stream ended before every target with frames skipped: the fill-in needs them all."""


def _collect(
    container,
    stream,
    info: _StreamInfo,
    targets: list[float],
    convert,
    stats: dict,
    spare: int,
    lower=None,
    snapped: list[bool] | None = None,
    skip: bool = False,
    cache: _KeyframeCache | None = None,
):
    """For each sorted target the first not yet used frame at or after it: [(time, converted, target_index)].

    A snapped target (a keyframe time) counts as reached SNAP_EPS_S early. With ``skip`` the decoder
    skips what no target needs (see ``_Gate``). When the stream ends before every target is served,
    up to `spare` skipped frames of the last run (not before lower[i], the segment start of the first
    unserved target) fill in, so short clips still reach the frame floor; if the decoder skipped
    frames on that run, the whole collection is redone without skipping so the fill-in is unchanged.
    A snapped target alone in its group whose keyframe is in ``cache`` is taken from there: no seek,
    no decode.
    """
    args = (container, stream, info, targets, convert, stats, spare, lower, snapped)
    try:
        picks = list(_iter_collect(*args, skip, cache))
    except _Regate:
        stats["regated"] = True
        picks = list(_iter_collect(*args, False, cache))
    return sorted(picks, key=lambda p: p[0])


class _Pushback:
    """A run of (time, frame) that takes back the one frame a look-ahead read too far."""

    def __init__(self, run):
        self.run, self.back = run, []

    def __iter__(self):
        return self

    def __next__(self):
        return self.back.pop() if self.back else next(self.run)

    def push(self, item) -> None:
        self.back.append(item)


def _iter_collect(container, stream, info, targets, convert, stats, spare, lower, snapped, skip, cache, screen=None):
    """``_collect``'s picks one at a time, in target order (the fill-in of a stream that ended early last,
    not in time order); raises ``_Regate`` before any fill-in. ``screen`` (a ``screening.Screener``): an exact
    target's frame that carries no picture gives way to the first useful frame decoded after it, before the
    next target and within the screener's look-ahead (``_screened``)."""
    taken: list[float] = []  # times of the frames given (the frames themselves are the caller's)
    skipped: deque = deque(maxlen=spare)
    snapped = snapped or [False] * len(targets)
    gate = _Gate() if skip else None
    run, cursor, order = None, -math.inf, 0

    def screened(t: float, frame):
        """(time, converted) of the frame to give for the exact target ``order`` reached at ``t``."""
        nonlocal cursor
        rgb = convert(frame)
        why, grey = screen.check(rgb)
        if not why or not screen.cfg.lookahead_frames:
            screen.given(order, grey, why, t)
            return t, rgb
        # Never past the next target (nor into the next segment): that frame is another target's.
        limit = math.inf
        if order + 1 < len(targets):
            limit = targets[order + 1] - (SNAP_EPS_S if snapped[order + 1] else 0.0)
            if lower and lower[order + 1] > lower[order]:
                limit = min(limit, lower[order + 1])
        for _ in range(screen.cfg.lookahead_frames):
            ahead = next(run, None)
            if ahead is None:
                break
            if ahead[0] >= limit:
                run.push(ahead)
                break
            cursor = ahead[0]
            other = convert(ahead[1])
            other_why, other_grey = screen.check(other)
            if not other_why:
                stats["frames_screened"] += 1
                screen.given(order, other_grey, why, t, round(ahead[0], 6))
                return ahead[0], other
        screen.given(order, grey, why, t)
        return t, rgb

    def keyframe_pick(target: float) -> bool:
        # A snapped keyframe already taken by the target before it: this one takes the next frame,
        # as an exact target would, so its chain must be decoded.
        return snapped[order] and not (taken and taken[-1] >= target - SNAP_EPS_S)

    groups = plan_seeks(targets, info.keyframes)
    for g, (key, group) in enumerate(groups):
        kept = cache.get(group[0]) if cache and len(group) == 1 and keyframe_pick(group[0]) else None
        if kept is not None:
            taken.append(kept[0])
            yield (kept[0], convert(kept[1]), order)
            stats["keyframes_reused"] += 1
            order += 1
            continue
        # A later group decodes on from this run only when its keyframe lies at or before the cursor,
        # never the case after a keyframe pick that ends its group.
        ends_run = g + 1 == len(groups) or groups[g + 1][0] > group[-1]
        if gate is not None:
            gate.aim(group[0], keyframe_pick(group[0]), ends_run and len(group) == 1)
        if run is None or cursor < key:  # past this keyframe already: decoding on is cheaper than a seek
            if gate is not None:
                gate.skipping = 0
            first = group[0] + SNAP_EPS_S if snapped[order] else group[0]  # landing on the keyframe is in time
            run, cursor = _Pushback(_start_run(container, stream, info, key, first, stats, gate)), -math.inf
            skipped.clear()
        for i, target in enumerate(group):
            if gate is not None:
                gate.aim(target, keyframe_pick(target), ends_run and i + 1 == len(group))
            reach = target - SNAP_EPS_S if snapped[order] else target
            for t, frame in run:
                cursor = t
                if t >= reach and (not taken or t > taken[-1]):
                    t, rgb = screened(t, frame) if screen is not None and not snapped[order] else (t, convert(frame))
                    taken.append(t)
                    yield (t, rgb, order)
                    break
                skipped.append((t, frame))
            else:
                if gate is not None and gate.skipping and spare:
                    raise _Regate
                used, floor = set(taken), lower[order] if lower else -math.inf
                fill = [(t, f) for t, f in skipped if t not in used and t >= floor][-(len(targets) - order) :]
                for i, (t, f) in enumerate(fill):
                    yield (t, convert(f), order + i)
                return
            order += 1


# Planar YUV is scaled in YUV, chroma at its own resolution, and converted to RGB after: about 2x
# cheaper than swscale's YUV-to-RGB resize in one step (1.7 vs 0.7 ms a 768x432 frame), within 1-2
# levels of it on average. Other formats (RGB, paletted) take the one step.
SCALE_IN_YUV = ("yuv420p", "yuvj420p", "yuv422p", "yuvj422p", "yuv444p", "yuvj444p")


class _Reformatters:
    """swscale contexts kept across the frames of one video. ``frame.reformat`` builds a new context for
    every frame, which is a third of a 768x432 frame's conversion (1.2 vs 0.8 ms); the pixels are the same."""

    def __init__(self):
        self.scale, self.rgb = VideoReformatter(), VideoReformatter()


def to_rgb(frame, width: int, height: int, reformatters: _Reformatters | None = None) -> np.ndarray:
    """The frame as RGB at width x height (bicubic): the one conversion every sampled frame goes through."""
    r = reformatters or _Reformatters()
    if frame.format.name in SCALE_IN_YUV and (frame.width, frame.height) != (width, height):
        frame = r.scale.reformat(frame, width=width, height=height, interpolation="BICUBIC")
    return r.rgb.reformat(frame, format="rgb24", width=width, height=height, interpolation="BICUBIC").to_ndarray()


class _Converter:
    """RGB at the budgeted size with rotation applied; size and rotation fixed by the first frame."""

    def __init__(self, cfg: SamplingConfig, rotation: int | None):
        self.cfg, self.rotation, self.size = cfg, rotation, None
        self.reformatters = _Reformatters()

    def __call__(self, frame) -> np.ndarray:
        if self.size is None:
            if self.rotation is None:
                self.rotation = int(frame.rotation or 0)
            w, h = frame.width, frame.height
            if rotation_turns(self.rotation) % 2:  # a quarter turn swaps the displayed sides
                w, h = h, w
            self.size = fit_to_budget(w, h, self.cfg)
        w, h = self.size
        if rotation_turns(self.rotation) % 2:
            w, h = h, w
        return apply_rotation(to_rgb(frame, w, h, self.reformatters), self.rotation)


class _Grey:
    """Low-res grey pictures for motion scores, one swscale context for the whole pass."""

    def __init__(self):
        self.reformatter = VideoReformatter()

    def __call__(self, frame) -> np.ndarray:
        w, h = MOTION_SIZE
        small = self.reformatter.reformat(frame, format="gray", width=w, height=h, interpolation="AREA")
        return small.to_ndarray().astype(np.float32)


def _scores(times_and_greys) -> list[tuple[float, float]]:
    """(time, score) for a stream of (time, grey): only the previous grey is held, whatever the length."""
    out, prev = [], None
    for t, g in times_and_greys:
        out.append((t, 0.0 if prev is None else float(np.abs(g - prev).mean() / 255.0)))
        prev = g
    return out


def keyframe_motion(
    source: str,
    info: _StreamInfo,
    stats: dict,
    cfg: SamplingConfig = SamplingConfig(),
    cache: _KeyframeCache | None = None,
):
    """(time, score) per keyframe: mean absolute grey difference to the previous keyframe, in [0, 1].

    Keyframe-only decoding (skip_frame NONKEY) is the cheap path. Codecs that ignore skip_frame
    (VP9, cinepak) return non-key frames: then each known keyframe is sought and decoded alone.
    On the keyframe-only path the keyframes go to ``cache`` when one is given (snapped targets reuse
    them); the seek-per-keyframe path keeps none.
    """
    with open_container(source, SamplingError) as container:
        stream = _open_stream(container, cfg)
        stream.codec_context.skip_frame = "NONKEY"
        grey, only_keys = _Grey(), True

        def keyframes():
            nonlocal only_keys
            for t, frame in _decode_run(container, stream, info.t0, 0.0, stats):
                stats["motion_frames_decoded"] += 1
                if not frame.key_frame:
                    only_keys = False  # the decoder ignores skip_frame: seek to each keyframe instead
                    return
                if cache is not None:
                    cache.keep(t, frame)
                yield t, grey(frame)

        scores = _scores(keyframes())
        if only_keys:
            stats["motion"] = "keyframe_only"
            return scores
    keys = info.keyframes
    if len(keys) < 3:
        stats["motion"] = "unavailable: fewer than 3 keyframes"
        return []
    keys = [keys[int(i)] for i in np.linspace(0, len(keys) - 1, min(len(keys), MOTION_MAX_POINTS))]
    with open_container(source, SamplingError) as container:
        stream = _open_stream(container, cfg)
        before = stats["frames_decoded"]
        # The targets are keyframes: nothing between them needs decoding (where the decoder obeys).
        # No spare frames, so no fill-in and no regate: the picks come in time order, scored as they come.
        picks = _iter_collect(container, stream, info, keys, _Grey(), stats, 0, None, [True] * len(keys), True, None)
        scores = _scores((t, g) for t, g, _ in picks)
        stats["motion_frames_decoded"] += stats["frames_decoded"] - before
    stats["motion"] = "seek_per_keyframe"
    return scores


def cut_candidates(motion: list[tuple[float, float]], duration_s: float) -> list[tuple[float, float]]:
    """Keyframe intervals whose ends differ enough to hide a cut; the whole video without two keyframes."""
    if len(motion) < 2:
        return [(0.0, duration_s)]
    return [(a, b) for (a, _), (b, score) in zip(motion, motion[1:]) if score > CUT_CANDIDATE_SCORE]


def adjacent_motion(
    source: str,
    info: _StreamInfo,
    spans: list[tuple[float, float]],
    stats: dict,
    cfg: SamplingConfig = SamplingConfig(),
):
    """[(time, score)] for consecutive frames inside each span: the frame-to-frame difference that marks a cut.

    Keyframe differences alone confuse a cut with seconds of handheld motion; decoding only the
    candidate intervals keeps this cheap.
    """
    out: list[tuple[float, float]] = []
    with open_container(source, SamplingError) as container:
        stream = _open_stream(container, cfg)
        run, cursor, prev, to_grey = None, -math.inf, None, _Grey()
        for a, b in spans:
            if run is None or cursor < a:
                run, prev = _start_run(container, stream, info, a, a, stats), None
            for t, frame in run:
                stats["cut_frames_decoded"] += 1
                cursor, grey = t, to_grey(frame)
                if prev is not None:
                    out.append((t, float(np.abs(grey - prev).mean() / 255.0)))
                prev = grey
                if t >= b:
                    break
    return out


def _plan(cfg: SamplingConfig, info: _StreamInfo, source: str, stats: dict, cache: _KeyframeCache | None = None):
    """[((start, end), targets, snapped)] per segment. Motion and cut passes run only when the config needs them."""
    long_video = cfg.motion_densify and info.duration_s > cfg.long_video_s
    motion = keyframe_motion(source, info, stats, cfg, cache) if (long_video or cfg.scene_split) else []
    cuts = []
    if cfg.scene_split:
        spans = cut_candidates(motion, info.duration_s)
        cuts = scene_boundaries(adjacent_motion(source, info, spans, stats, cfg))
        stats["cuts"] = [round(c, 3) for c in cuts]
    plans = []
    for start, end in segment_ranges(info.duration_s, cfg.segment_s, cuts):
        targets = plan_timestamps(end - start, cfg, start)
        if long_video:
            targets = densify_around_motion(targets, motion, cfg, end - start, start)
        snapped = [False] * len(targets)
        if cfg.keyframe_snap_s > 0:
            targets, snapped = snap_to_keyframes(targets, info.keyframes, cfg.keyframe_snap_s, start, end)
        plans.append(((start, end), targets, snapped))
    return plans


def worth_skipping(targets: int, duration_s: float, fps) -> bool:
    """Whether the decoder should skip the frames no target needs. Not on a stream with fewer than two
    frames a target (a clip shorter than the frame floor): little is skipped, and the stream may end
    before the last target, when the frames skipped are needed as fill-in and everything would be
    decoded a second time (``_Regate``)."""
    return not fps or duration_s * float(fps) >= 2 * targets


def sample_video(
    source: str | Path,
    cfg: SamplingConfig = SamplingConfig(),
    duration_s: float | None = None,
    rotation: int | None = None,
) -> SampledVideo:
    """Decode the planned frames of the video at ``source`` (a local path or an object-store / http(s)
    URI, see ``media.source``); duration and rotation come from the file when not given. Every pass
    opens the source anew and closes what it opened. All segments at once: ``SegmentStream`` gives them
    one at a time."""
    stream = SegmentStream(source, cfg, duration_s, rotation)
    segments = list(stream)
    return SampledVideo(stream.duration_s, stream.rotation, segments, stream.decode_stats)


class SegmentStream:
    """``sample_video`` one segment at a time: iterating it decodes the video once and yields each
    ``Segment`` as soon as its last frame is decoded, so memory holds one segment's frames whatever the
    video's length (an hour of CCTV at ``segment_s`` 30 is 120 segments). ``planned`` (the segment count)
    and ``duration_s`` are set before the first segment comes; ``rotation`` and ``decode_stats`` are whole
    at the end. A decode error after some segments raises ``SamplingError`` then (those already yielded
    stand)."""

    def __init__(
        self,
        source: str | Path,
        cfg: SamplingConfig = SamplingConfig(),
        duration_s: float | None = None,
        rotation: int | None = None,
    ):
        self.source, self.cfg, self._duration_s, self._rotation = str(source), cfg, duration_s, rotation
        self.duration_s: float = 0.0
        self.planned: int = 0
        self.rotation: int = 0
        self.decode_stats: dict = _new_stats()
        self._returned = 0  # frames in the segments given so far
        self._screener: Screener | None = None
        self._owner: list[int] = []

    def __iter__(self) -> Iterator[Segment]:
        began, cfg, stats = time.perf_counter(), self.cfg, self.decode_stats
        with open_container(self.source, SamplingError) as container:
            if not container.streams.video:
                raise SamplingError("no video stream")
            stream = _open_stream(container, cfg)
            try:
                info = _stream_info(container, stream, self._duration_s, exact_keys=cfg.keyframe_snap_s > 0)
                # Snapped targets are keyframes the motion pass (when it runs) has decoded already.
                cache = _KeyframeCache() if cfg.keyframe_snap_s > 0 else None
                plans = _plan(cfg, info, self.source, stats, cache)
                self.duration_s, self.planned = info.duration_s, len(plans)
                targets = [t for _, ts, _ in plans for t in ts]
                snapped = [s for _, _, ss in plans for s in ss]
                owner = [i for i, (_, ts, _) in enumerate(plans) for _ in ts]
                lower = [plans[i][0][0] for i in owner]
                convert = _Converter(cfg, self._rotation)
                skip = worth_skipping(len(targets), info.duration_s, stream.average_rate or stream.guessed_rate)
                args = (container, stream, info, targets, convert, stats, cfg.min_frames, lower, snapped)
                self._screener = Screener(cfg.screen) if cfg.screen is not None else None
                self._owner = owner
                done, held = 0, []  # segments yielded; the next one's picks
                for skipping in (skip, False):
                    try:
                        for t, rgb, k in _iter_collect(*args, skipping, cache, self._screener):
                            mine = owner[min(k, len(owner) - 1)]
                            if mine < done:  # a redo (below) decoding again a segment already given
                                continue
                            while mine > done:
                                yield self._segment(plans, done, held, convert)
                                done, held = done + 1, []
                            held.append((t, rgb))
                        break
                    except _Regate:
                        # The stream ended before the last targets and their fill-in was skipped: the rest
                        # again without skipping (the segments already given are not decoded differently).
                        stats["regated"], held = True, []
            except av.error.FFmpegError as exc:
                raise SamplingError(f"decoding failed: {_readable(exc)}") from exc
            if not self._returned and not held:
                failed = f" ({stats['decode_errors']} packets failed to decode)" if stats["decode_errors"] else ""
                raise SamplingError("no decodable video frame" + failed)
            while done < len(plans):
                yield self._segment(plans, done, held, convert)
                done, held = done + 1, []
        self.rotation = int(convert.rotation or 0)
        stats.update(
            duration_estimated=info.duration_estimated,
            keyframes=len(info.keyframes),
            packets_scanned=info.packets,
            keyframe_only=stats["motion"] == "keyframe_only",
            frames_returned=self._returned,
            snapped=sum(snapped),
            seconds=round(time.perf_counter() - began, 4),
        )

    def _segment(self, plans, i: int, held: list, convert) -> Segment:
        (start, end), _, _ = plans[i]
        held = sorted(held, key=lambda p: p[0])  # a stream that ended early: fill-in frames come last
        self._returned += len(held)
        w, h = convert.size
        frames = np.stack([rgb for _, rgb in held]) if held else np.zeros((0, h, w, 3), np.uint8)
        times = [t for t, _ in held]
        return Segment(i, start, end, times, frames, self._screened(i, times))

    def _screened(self, i: int, times: list[float]) -> list[dict]:
        """Segment ``i``'s screening records, each with the index of its frame in the segment."""
        if self._screener is None:
            return []
        out = []
        for k, entry in sorted(self._screener.screened.items()):
            if self._owner[min(k, len(self._owner) - 1)] != i:
                continue
            given = entry["to_s"] if entry["to_s"] is not None else entry["from_s"]
            j = min(range(len(times)), key=lambda n: abs(times[n] - given), default=None)
            if j is not None:
                out.append({"frame": j, **entry})
        return out


def sample_times(
    source: str | Path,
    times: list[float],
    cfg: SamplingConfig = SamplingConfig(),
    rotation: int | None = None,
    stats: dict | None = None,
) -> tuple[list[float], np.ndarray]:
    """The frames at ``times``, which are frame times this module returned before (e.g. the frames a
    caption saw), decoded again with the same plan rules (seek to the keyframe before, skip what no
    target needs) and the same size and rotation: later stages see exactly what the VLM saw. Returns
    the times of the frames found and the frames; a time past the end of the stream is left out.
    ``stats``: a dict that gets this call's decode counters (``frames_decoded``, ...), replacing its own."""
    if not times:
        return [], np.zeros((0, 1, 1, 3), np.uint8)
    if stats is None:
        stats = {}
    stats.update(_new_stats())
    targets = sorted(set(float(t) for t in times))
    with open_container(str(source), SamplingError) as container:
        if not container.streams.video:
            raise SamplingError("no video stream")
        stream = _open_stream(container, cfg)
        try:
            info = _stream_info(container, stream, None)
            convert = _Converter(cfg, rotation)
            # A stored time is a frame's own time: aiming a hair before it takes that very frame.
            picks = _collect(container, stream, info, [t - SNAP_EPS_S for t in targets], convert, stats, 0, skip=True)
        except av.error.FFmpegError as exc:
            raise SamplingError(f"decoding failed: {_readable(exc)}") from exc
    if not picks:
        raise SamplingError("no decodable video frame at the requested times")
    return [t for t, _, _ in picks], np.stack([rgb for _, rgb, _ in picks])


def match_times(found: list[float], times: list[float], tol: float = SNAP_EPS_S) -> list[int | None]:
    """For each of ``times``, the index in ``found`` (sorted frame times, as ``sample_times`` returns them)
    of the same frame (equal up to ``tol``: frames are >= 4 ms apart), or None when it did not decode."""
    out = []
    for t in times:
        k = bisect.bisect_left(found, t - tol)
        out.append(k if k < len(found) and abs(found[k] - t) < tol else None)
    return out
