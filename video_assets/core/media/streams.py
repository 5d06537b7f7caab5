"""The one PyAV stream scan and duration rule, shared by the probe and the frame sampler.

Times here are seconds of the stream's own clock; callers subtract ``start_s`` where they want
times from the first presentation (the sampler does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import av


@dataclass
class PacketScan:
    packets: int = 0  # every packet with data (a frame count when the container stores none)
    end_s: float | None = None  # latest pts + duration seen
    keyframes: list[float] = field(default_factory=list)  # keyframe presentation times


def start_s(stream) -> float:
    return float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0


def stored_duration(container, stream) -> float | None:
    """The duration the file states: the stream's, else the container's; None when neither does."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / av.time_base
    return None


def scan_packets(container, stream, limit: int | None = None) -> PacketScan:
    """Demux (never decode) up to ``limit`` packets of ``stream``: count, end time, keyframe times.

    Demuxing is cheap but still reads the bytes: on a 10 GB file a full scan reads all of them, so
    callers scan in full only when the container stores no duration (or index) to trust.
    """
    scan = PacketScan()
    tb = float(stream.time_base)  # float, not Fraction: Fraction arithmetic was most of a scan's Python time
    for packet in container.demux(stream):
        if packet.size == 0 and packet.pts is None:  # flush packet
            continue
        scan.packets += 1
        if packet.pts is not None:
            t = packet.pts * tb
            t_end = t + (packet.duration or 0) * tb
            scan.end_s = t_end if scan.end_s is None else max(scan.end_s, t_end)
            if packet.is_keyframe:
                scan.keyframes.append(t)
        if limit is not None and scan.packets >= limit:
            break
    return scan


def scanned_duration(scan: PacketScan, stream) -> float | None:
    """Duration estimated from the packets: last end minus the stream start."""
    if scan.end_s is None:
        return None
    return max(0.0, scan.end_s - start_s(stream))


# A file cut short still states its full duration in a header written first (MP4 with the index at the
# front, Matroska). A gap below this is normal (audio outlasting video in the container's duration).
TRUNCATION_MIN_GAP_S = 1.0
TRUNCATION_MIN_GAP_RATIO = 0.02
TAIL_WINDOW_S = 5.0


def last_packet_end(container, stream, declared_s: float) -> float | None:
    """Seconds from the stream start to the end of the last packet really in the file.

    Seeks to ``TAIL_WINDOW_S`` before the declared end and demuxes from there (cheap: only the tail);
    when nothing is found there (the data stops earlier) it scans from the start. None when the
    container cannot seek.
    """
    target = start_s(stream) + max(0.0, declared_s - TAIL_WINDOW_S)
    try:
        container.seek(int(target / stream.time_base), stream=stream, backward=True)
        tail = scan_packets(container, stream)
        if tail.end_s is None:
            container.seek(stream.start_time or 0, stream=stream)
            tail = scan_packets(container, stream)
    except (av.error.FFmpegError, OSError, ValueError):
        return None
    return None if tail.end_s is None else tail.end_s - start_s(stream)


def truncation(declared_s: float, real_s: float | None) -> str | None:
    """Why the file is cut short (its packets end well before the stated duration), or None."""
    if real_s is None:
        return None
    gap = declared_s - real_s
    if gap > max(TRUNCATION_MIN_GAP_S, TRUNCATION_MIN_GAP_RATIO * declared_s):
        return (
            f"truncated: the video stream ends at {real_s:.2f} s of the {declared_s:.2f} s its header states "
            "(file cut short, e.g. an interrupted upload or copy)"
        )
    return None
