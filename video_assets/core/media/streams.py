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
    tb = stream.time_base
    for packet in container.demux(stream):
        if packet.size == 0 and packet.pts is None:  # flush packet
            continue
        scan.packets += 1
        if packet.pts is not None:
            t = float(packet.pts * tb)
            t_end = t + float((packet.duration or 0) * tb)
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
