"""Probe a video in-process with PyAV: container facts, checked against the packets, and proof the stream decodes.

Near the cost of a bare header open: frame count, frame times and keyframes come from the index the
MP4/AVI demuxer already read at open, and decodability from the frames FFmpeg decodes at open to learn
the pixel format; only other containers demux their packets and decode a frame here.

A file that cannot be opened, has no video stream or decodes no frame is returned as ``ok=False``
with a readable reason; ``probe`` never raises for bad input.
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import IO, Any

import av

from video_assets.core.media.streams import (
    last_packet_end,
    scan_packets,
    scanned_duration,
    start_s,
    stored_duration,
    truncation,
)

# Demuxing (not decoding) packets is cheap, but on a 10 GB file it still reads every byte, so
# the full scan runs only when the container stores no duration or frame count.
KEYFRAME_SAMPLE_PACKETS = 600
FIRST_FRAME_MAX_PACKETS = 300
MP4 = "mov,mp4,m4a,3gp,3g2,mj2"
# Demuxers that list every frame (time, keyframe flag, byte range) in the index at open, from the MP4
# sample tables and the AVI idx1. Matroska cues and MPEG-PS index only keyframes, so those scan.
FULL_INDEX_FORMATS = (MP4, "avi")
# Packet timing overrides the header's average rate past this relative gap (VFR, AVI drop frames).
FPS_DISAGREEMENT = 0.01


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
    try:  # flush: some decoders hold frames until the end of the stream (or the reorder delay)
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


@dataclass
class _Packets:
    """What the packets say, from the container index or a demux scan."""

    count: int | None = None  # frames with data; None when only part of the stream was seen
    keyframes: list[float] | None = None
    fps: float | None = None  # mean rate of the frames' own timestamps
    end_s: float | None = None  # where the frames really in the file end (None: not known)


def _from_index(container, stream, duration: float) -> _Packets | None:
    """Count, times and keyframes of every frame from the index the demuxer built at open; where the
    bytes of a listed frame lie past the end of the file, the file was cut there. None: no index, or
    one short of the stated duration with all its bytes present (fragmented MP4 indexes as it reads)."""
    entries = stream.index_entries
    size = container.size
    if not entries or not size or size < 0:
        return None
    tb = stream.time_base
    times, keys, cut_at = [], [], None
    for e in entries:
        if e.size == 0 or e.is_discard:  # an AVI drop frame (repeat the last) or one an edit list trims
            continue
        t = float(e.timestamp * tb)
        times.append(t)
        if e.is_keyframe:
            keys.append(t)
        if e.pos + e.size > size and (cut_at is None or t < cut_at):
            cut_at = t
    if not times:
        return None
    first, last = min(times), max(times)
    span = last - first
    fps = (len(times) - 1) / span if span > 0 else None
    # The last frame lasts one mean frame interval (the index stores no durations).
    end = (cut_at if cut_at is not None else last + (1 / fps if fps else 0.0)) - start_s(stream)
    if cut_at is None and truncation(duration, end):
        return None
    return _Packets(count=len(times), keyframes=keys, fps=fps, end_s=end)


def _from_scan(container, stream, duration: float | None) -> _Packets:
    """Demux the packets: all of them when the header lacks a duration or frame count, else a sample
    for keyframes plus a read of the tail to catch a file cut short."""
    full = duration is None or not stream.frames
    scan = scan_packets(container, stream, None if full else KEYFRAME_SAMPLE_PACKETS)
    keys = scan.keyframes
    if len(set(keys)) < 2:  # few keyframes early on: the container index (mkv cues) may know more
        keys = [float(e.timestamp * stream.time_base) for e in stream.index_entries or [] if e.is_keyframe]
    seen = scanned_duration(scan, stream)
    fps = scan.packets / seen if scan.packets and seen else None
    if full:
        return _Packets(count=scan.packets or None, keyframes=keys, fps=fps, end_s=seen)
    return _Packets(keyframes=keys, fps=fps, end_s=last_packet_end(container, stream, duration))


def _mp4_boxes(f, start: int, end: int):
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        head = f.read(8)
        if len(head) < 8:
            return
        size, kind = struct.unpack(">I4s", head)
        skip = 8
        if size == 1:
            size, skip = struct.unpack(">Q", f.read(8))[0], 16
        elif size == 0:
            size = end - pos
        if size < skip:
            return
        yield kind, pos + skip, min(pos + size, end)
        pos += size


def _matrix(f, at: int) -> list[list[int]]:
    f.seek(at)
    m = struct.unpack(">9i", f.read(36))
    return [list(m[0:3]), list(m[3:6]), list(m[6:9])]


def _mp4_rotation(f) -> int | None:
    """The first video track's display rotation as FFmpeg reports it on decoded frames (tkhd matrix
    composed with mvhd's, then av_display_rotation_get), read from the box headers alone.
    None when this is not an MP4/MOV or the boxes are not as expected."""
    f.seek(0, 2)
    size = f.tell()
    top = dict((k, (s, e)) for k, s, e in _mp4_boxes(f, 0, size) if k in (b"ftyp", b"moov"))
    if b"moov" not in top:
        return None
    movie = [[1 << 16, 0, 0], [0, 1 << 16, 0], [0, 0, 1 << 30]]
    for kind, s, e in _mp4_boxes(f, *top[b"moov"]):
        if kind == b"mvhd":
            f.seek(s)
            movie = _matrix(f, s + (48 if f.read(1) == b"\x01" else 36))
        elif kind == b"trak":
            track, handler = None, None
            for k, ts, te in _mp4_boxes(f, s, e):
                if k == b"tkhd":
                    f.seek(ts)
                    track = _matrix(f, ts + (52 if f.read(1) == b"\x01" else 40))
                elif k == b"mdia":
                    for mk, ms, _ in _mp4_boxes(f, ts, te):
                        if mk == b"hdlr":
                            f.seek(ms + 8)
                            handler = f.read(4)
            if handler == b"vide" and track is not None:
                return _display_rotation(track, movie)
    return None


def _display_rotation(track: list[list[int]], movie: list[list[int]]) -> int:
    shift = (16, 16, 30)  # 16.16, 16.16 and 2.30 fixed point columns, as mov.c multiplies them
    m = [[sum((track[i][e] * movie[e][j]) >> shift[e] for e in range(3)) for j in range(3)] for i in range(3)]
    a, b, c, d = m[0][0] / 65536, m[0][1] / 65536, m[1][0] / 65536, m[1][1] / 65536
    sx, sy = math.hypot(a, c), math.hypot(b, d)
    if not sx or not sy:
        return 0
    return int(-math.degrees(math.atan2(b / sy, a / sx)))


def _read_mp4_rotation(source: str | IO[bytes]) -> int | None:
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                return _mp4_rotation(f)
        at = source.tell()
        try:
            return _mp4_rotation(source)
        finally:
            source.seek(at)
    except (OSError, ValueError, struct.error):
        return None


def probe(source: str | IO[bytes]) -> ProbeResult:
    """Probe a path or a seekable binary stream."""
    try:
        container = av.open(source, mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        return ProbeResult(ok=False, error=f"cannot open as a media container: {_readable(exc)}")
    try:
        result, need_rotation = _probe_open(container)
    except Exception as exc:  # a demuxer bug on a damaged file must not take the run down
        return ProbeResult(ok=False, error=f"probe failed: {_readable(exc)}")
    finally:
        container.close()
    if need_rotation:  # read after PyAV is done with a stream source, which shares its position
        rotation = _read_mp4_rotation(source)
        if rotation is None:  # boxes not as expected: decode a frame for it after all
            return _decoded_probe(source)
        result.rotation = rotation
    return result


def _decoded_probe(source: str | IO[bytes]) -> ProbeResult:
    if not isinstance(source, str):
        source.seek(0)
    try:
        with av.open(source, mode="r", metadata_errors="ignore") as container:
            return _probe_open(container, decode=True)[0]
    except Exception as exc:
        return ProbeResult(ok=False, error=f"probe failed: {_readable(exc)}")


def _probe_open(container, decode: bool = False) -> tuple[ProbeResult, bool]:
    """The probe on an open container; the flag: rotation still to read from the MP4 boxes."""
    result = ProbeResult(ok=False, container=container.format.name)
    result.bit_rate = int(container.bit_rate) if container.bit_rate else None
    if container.streams.audio:
        result.audio_codec = container.streams.audio[0].codec_context.codec.canonical_name
    if not container.streams.video:
        result.error = "no video stream"
        return result, False
    if container.format.name == "image2" or container.format.name.endswith("_pipe"):
        # FFmpeg opens a renamed JPEG/PNG as a one-frame "video": there is no timeline to caption.
        result.error = f"a still image ({container.format.name}), not a video"
        return result, False
    stream = container.streams.video[0]
    ctx = stream.codec_context
    result.video_codec = ctx.codec.canonical_name
    result.width = ctx.width or None
    result.height = ctx.height or None
    result.avg_fps = _rate(stream.average_rate)
    result.real_fps = _rate(stream.base_rate)

    duration = stored_duration(container, stream)
    packets = None
    if duration is not None and container.format.name in FULL_INDEX_FORMATS:
        packets = _from_index(container, stream, duration)
    if packets is None:
        packets = _from_scan(container, stream, duration)
    result.duration_estimated = duration is None
    cut_short = truncation(duration, packets.end_s) if duration is not None else None
    if duration is None:
        duration = packets.end_s
    result.duration_s = round(duration, 4) if duration is not None else None
    # Packets over the header: an AVI header counts drop frames that carry no picture.
    result.frame_count = packets.count or stream.frames or None
    result.keyframe_interval_s = _keyframe_interval(packets.keyframes or [])
    if packets.fps and (not result.avg_fps or abs(packets.fps / result.avg_fps - 1) > FPS_DISAGREEMENT):
        # A VFR stream whose header gives the first frames' rate, or AVI drop frames: the packets win.
        result.avg_fps = round(packets.fps, 4)
    if result.avg_fps is None and result.frame_count and result.duration_s:
        result.avg_fps = round(result.frame_count / result.duration_s, 4)

    # FFmpeg's open decodes the first frames of an MP4 to learn the pixel format, so a known format
    # proves they decode; the rotation then comes from the boxes. Elsewhere decode one frame here.
    skip_decode = not decode and container.format.name == MP4 and ctx.pix_fmt is not None and ctx.width
    if not skip_decode:
        container.seek(stream.start_time or 0, stream=stream)
        ctx.thread_count = 1  # one frame: threads would only delay it
        frame, error = _first_frame(container, stream)
        if frame is None:
            result.error = "no decodable video frame" + (f": {_readable(error)}" if error else "")
            return result, False
        result.width = result.width or frame.width
        result.height = result.height or frame.height
        result.rotation = int(frame.rotation or 0)
    if not result.duration_s:
        result.error = "video stream has no duration and no timed packets"
        return result, False
    if cut_short:  # ok=false: captioning then skips it with this reason instead of sampling past the end
        result.error = cut_short
        return result, bool(skip_decode)
    result.ok = True
    return result, bool(skip_decode)
