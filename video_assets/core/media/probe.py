"""Probe a video in-process with PyAV: container facts plus one decoded frame to prove it is usable.

A file that cannot be opened, has no video stream or decodes no frame is returned as ``ok=False``
with a readable reason; ``probe`` never raises for bad input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import IO, Any

import av

from video_assets.core.media.streams import (
    last_packet_end,
    scan_packets,
    scanned_duration,
    stored_duration,
    truncation,
)

# Demuxing (not decoding) packets is cheap, but on a 10 GB file it still reads every byte, so
# the full scan runs only when the container stores no duration or frame count.
KEYFRAME_SAMPLE_PACKETS = 600
FIRST_FRAME_MAX_PACKETS = 300


@dataclass
class ProbeResult:
    ok: bool
    error: str | None = None
    container: str | None = None
    video_codec: str | None = None
    width: int | None = None
    height: int | None = None
    rotation: int | None = None
    avg_fps: float | None = None
    real_fps: float | None = None
    duration_s: float | None = None
    duration_estimated: bool | None = None
    frame_count: int | None = None
    keyframe_interval_s: float | None = None
    audio_codec: str | None = None
    bit_rate: int | None = None

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def _rate(value: Fraction | None) -> float | None:
    if value is None or value == 0:
        return None
    return round(float(value), 4)


def _readable(exc: BaseException) -> str:
    text = str(exc).strip() or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"


def _first_frame(container: av.container.InputContainer, stream: av.video.stream.VideoStream):
    """First decodable frame, or the last decoder error; damaged streams often recover a few packets in."""
    last_error: BaseException | None = None
    for i, packet in enumerate(container.demux(stream)):
        if i >= FIRST_FRAME_MAX_PACKETS:
            break
        try:
            for frame in packet.decode():
                return frame, None
        except av.error.FFmpegError as exc:
            last_error = exc
    try:  # flush: some decoders hold frames until the end of the stream
        for frame in stream.decode(None):
            return frame, None
    except av.error.FFmpegError as exc:
        last_error = exc
    return None, last_error


def _keyframe_interval(keys: list[float]) -> float | None:
    keys = sorted(set(keys))
    if len(keys) < 2:
        return None
    return round((keys[-1] - keys[0]) / (len(keys) - 1), 4)


def probe(source: str | IO[bytes]) -> ProbeResult:
    """Probe a path or a seekable binary stream."""
    try:
        container = av.open(source, mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        return ProbeResult(ok=False, error=f"cannot open as a media container: {_readable(exc)}")
    try:
        return _probe_open(container)
    except Exception as exc:  # a demuxer bug on a damaged file must not take the run down
        return ProbeResult(ok=False, error=f"probe failed: {_readable(exc)}")
    finally:
        container.close()


def _probe_open(container) -> ProbeResult:
    result = ProbeResult(ok=False, container=container.format.name)
    result.bit_rate = int(container.bit_rate) if container.bit_rate else None
    if container.streams.audio:
        result.audio_codec = container.streams.audio[0].codec_context.codec.canonical_name
    if not container.streams.video:
        result.error = "no video stream"
        return result
    if container.format.name == "image2" or container.format.name.endswith("_pipe"):
        # FFmpeg opens a renamed JPEG/PNG as a one-frame "video": there is no timeline to caption.
        result.error = f"a still image ({container.format.name}), not a video"
        return result
    stream = container.streams.video[0]
    ctx = stream.codec_context
    result.video_codec = ctx.codec.canonical_name
    result.width = ctx.width or None
    result.height = ctx.height or None
    result.avg_fps = _rate(stream.average_rate)
    result.real_fps = _rate(stream.base_rate)

    # Duration and frame count as stored; either missing -> scan every packet.
    duration = stored_duration(container, stream)
    frames = stream.frames or None
    need_full_scan = duration is None or frames is None
    scan = scan_packets(container, stream, None if need_full_scan else KEYFRAME_SAMPLE_PACKETS)
    count, keys = scan.packets, scan.keyframes
    if len(set(keys)) < 2:  # few keyframes early on: the container index (mp4, mkv) may know more
        keys = [float(e.timestamp * stream.time_base) for e in stream.index_entries or [] if e.is_keyframe]
    result.duration_estimated = duration is None
    cut_short = None
    if duration is not None:  # a stated duration: check the packets really reach it
        real = scanned_duration(scan, stream) if need_full_scan else last_packet_end(container, stream, duration)
        cut_short = truncation(duration, real)
    if duration is None:
        duration = scanned_duration(scan, stream)
    result.duration_s = round(duration, 4) if duration is not None else None
    result.frame_count = frames if frames is not None else (count or None)
    result.keyframe_interval_s = _keyframe_interval(keys)
    if result.avg_fps is None and result.frame_count and result.duration_s:
        result.avg_fps = round(result.frame_count / result.duration_s, 4)

    container.seek(stream.start_time or 0, stream=stream)
    frame, error = _first_frame(container, stream)
    if frame is None:
        result.error = "no decodable video frame" + (f": {_readable(error)}" if error else "")
        return result
    result.width = result.width or frame.width
    result.height = result.height or frame.height
    result.rotation = int(frame.rotation or 0)
    if not result.duration_s:
        result.error = "video stream has no duration and no timed packets"
        return result
    if cut_short:  # ok=false: captioning then skips it with this reason instead of sampling past the end
        result.error = cut_short
        return result
    result.ok = True
    return result
