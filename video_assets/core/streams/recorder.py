"""The recorder of one camera: its stream read with PyAV and cut at keyframes into segments of about
``segment_s`` without re-encoding (the packets are remuxed as they came), each written as
``.<name>.part`` and renamed into ``streams/<camera>/<UTC start>.mp4`` when whole, so the upload sensor
registers each finished segment exactly once. Pure of Dagster: the caller says where the volume's folder is
and what to do with each segment's row (``on_segment``: the ``stream_segments`` table).

A stream that is not there yet, ends, stalls (no packet for ``stall_s``: the demuxer's read timeout), sends
what cannot be demuxed, or changes its picture size (each keyframe is decoded to see it) closes the segment
being written (kept: it is valid up to its last packet) and is opened again after a backoff with jitter (1 s
doubling to ``max_backoff_s``); the next segment's row says why there was a gap and how long it was. Nothing
here raises out of ``record``: it returns when ``stop`` is set or after ``max_connects`` attempts.

Each camera's health (``on_health``: the ``camera_health`` row) says what it is doing: ``connecting``,
``recording``, ``failing`` (an attempt that recorded nothing: its reason in ``last_error``, the count in
``consecutive_failures``) or ``stopped``; each failed attempt is logged at warning level. Opening waits at most
``stall_s``; an HLS camera is read through ``core.streams.hls`` (hosts and playlist bytes bounded).
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
import urllib.error
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import av

from video_assets.core.streams.config import Camera
from video_assets.core.streams.hls import DEMUXER_OPTIONS, HlsIO, Refused, is_hls

log = logging.getLogger(__name__)
FIRST, CUT, RECONNECT, ENDED, STOPPED = "first", "cut", "reconnect", "stream ended", "stopped"
CONNECTING, RECORDING, FAILING = "connecting", "recording", "failing"  # and STOPPED: a camera's health status


@dataclass
class _Open:
    """The segment being written."""

    part: Path
    final: Path
    container: object
    stream: object
    started_at: datetime  # wall clock of its first packet
    first_pts: int
    last_pts: int
    last_duration: int
    frames: int = 0


def _name(started_at: datetime) -> str:
    return started_at.strftime("%Y%m%dT%H%M%S.%fZ")[:-4] + "Z"  # milliseconds: two segments never collide


def _options(camera: Camera) -> dict[str, str]:
    timeout_us = str(int(camera.stall_s * 1_000_000))
    if camera.url.startswith(("rtsp://", "rtsps://")):
        return {"rtsp_transport": "tcp", "timeout": timeout_us}
    if is_hls(camera):
        return dict(DEMUXER_OPTIONS)
    return {"rw_timeout": timeout_us}


def _describe(exc: BaseException) -> str:
    """An error as one short line for logs and tables: never the URL PyAV puts in its errors (credentials)."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    text = exc.strerror if isinstance(exc, av.error.FFmpegError) else str(exc)
    text = "".join(c if c.isprintable() else " " for c in " ".join(str(text or "").split()))[:200]
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


class _KeyframeProbe:
    """The picture size of each keyframe, decoded alone. The demuxer keeps the parameters it probed at
    connect (an in-band change of resolution never reaches the stream's codec parameters), so a segment
    would carry packets its header does not describe; one keyframe a GOP costs a few ms of CPU."""

    def __init__(self, src):
        self.decoder = av.CodecContext.create(src.codec_context.name, "r")
        self.decoder.extradata = src.codec_context.extradata
        self.decoder.thread_type = "NONE"  # one frame in, one out: no frame-thread delay

    def shape(self, packet) -> tuple[int, int] | None:
        try:
            frames = self.decoder.decode(packet) + self.decoder.decode(None)
        except av.error.FFmpegError:
            frames = []
        finally:
            self.decoder.flush_buffers()  # ready for the next keyframe after the drain
        return (frames[0].width, frames[0].height) if frames else None


class Recorder:
    """Records one camera into ``folder`` (the volume's ``streams/<camera>``) until ``stop`` is set."""

    def __init__(
        self,
        camera: Camera,
        folder: Path,
        on_segment: Callable[[dict], None],
        stop: threading.Event | None = None,
        max_backoff_s: float = 30.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        env: Mapping[str, str] | None = None,
        on_health: Callable[[dict], None] | None = None,
    ):
        self.camera, self.folder, self.on_segment, self.on_health = camera, Path(folder), on_segment, on_health
        self.env = env or {}  # where username_env / password_env are looked up
        self.stop = stop or threading.Event()
        self.max_backoff_s, self.clock = max_backoff_s, clock
        self.segments = 0
        self.connects = 0
        self._reason = FIRST  # why the next segment starts where it does
        self._last_end: datetime | None = None
        # Within one connection a segment starts where the one before ended (the stream's own clock); the
        # first segment of a connection starts at the wall clock of its first packet.
        self._next_start: datetime | None = None
        now = self.clock()
        self.health = {"camera": camera.name, "source": camera.redacted, "status": CONNECTING, "since": now}
        self.health |= {"connects": 0, "consecutive_failures": 0, "last_error": None, "last_error_at": None}
        self.health |= {"last_segment": None, "last_segment_at": None, "updated_at": now}

    def _report(self, **changes) -> None:
        """Update the camera's health and hand its row to ``on_health`` (a failure to write it is logged only)."""
        now = self.clock()
        if changes.get("status", self.health["status"]) != self.health["status"]:
            changes["since"] = now
        self.health |= changes | {"connects": self.connects, "updated_at": now}
        if self.on_health is not None:
            try:
                self.on_health(dict(self.health))
            except Exception as exc:
                log.warning("%s: its health row was not written (%s)", self.camera.name, _describe(exc))

    # -- one segment -----------------------------------------------------------------------------------

    def _start(self, template, packet) -> _Open:
        # A new connection's first segment never starts before the last one ended (a stream read faster than
        # real time, e.g. an HLS playlist's back segments, runs its own clock ahead of the wall clock).
        started_at = self._next_start or max(self.clock(), self._last_end or datetime.min.replace(tzinfo=UTC))
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"{_name(started_at)}.mp4"
        part = self.folder / f".{final.name}.part"
        container = av.open(str(part), "w", format="mp4")
        stream = container.add_stream_from_template(template)
        return _Open(part, final, container, stream, started_at, packet.pts, packet.pts, packet.duration or 0)

    def _write(self, seg: _Open, packet) -> None:
        # Times from 0 in each file; the packets themselves are not decoded or encoded.
        packet.pts -= seg.first_pts
        packet.dts = (packet.dts - seg.first_pts) if packet.dts is not None else None
        packet.stream = seg.stream
        seg.container.mux(packet)
        seg.frames += 1

    def _finish(self, seg: _Open, time_base, reason_next: str) -> None:
        try:
            seg.container.close()
        except Exception as exc:  # a segment that cannot be finished is dropped, and said so
            log.warning("%s: segment %s could not be closed (%s); dropped", self.camera.name, seg.final.name, exc)
            seg.part.unlink(missing_ok=True)
            self._reason = f"{RECONNECT}: a segment was lost ({exc.__class__.__name__})"
            return
        duration_s = float((seg.last_pts - seg.first_pts + seg.last_duration) * time_base)
        seg.part.rename(seg.final)  # whole: only now can the sensor see it
        ended_at = seg.started_at + timedelta(seconds=duration_s)
        gap = None if self._last_end is None else (seg.started_at - self._last_end).total_seconds()
        row = {
            "camera": self.camera.name,
            "uri": str(seg.final),
            "source": self.camera.redacted,
            "started_at": seg.started_at,
            "ended_at": ended_at,
            "duration_s": duration_s,
            "frames": seg.frames,
            "gap_before_s": gap,
            "reason": self._reason,
        }
        self._last_end, self._reason = ended_at, reason_next
        self._next_start = ended_at if reason_next == CUT else None
        self.segments += 1
        self.on_segment(row)
        self._report(last_segment=row["uri"], last_segment_at=self.clock())

    # -- one connection -----------------------------------------------------------------------------

    def _session(self) -> str:
        """Read the stream until it ends, fails or ``stop``; returns why it ended (the next gap's reason)."""
        hls = HlsIO(self.camera, self.env) if is_hls(self.camera) else None
        # An HLS camera's credentials go in HlsIO's requests, not in the URL FFmpeg sees.
        url, extra = (
            (self.camera.url, {"format": "hls", "io_open": hls}) if hls else (self.camera.open_url(self.env), {})
        )
        opening = time.monotonic()
        try:
            container = av.open(url, options=_options(self.camera), timeout=self.camera.stall_s, **extra)
        except Exception as exc:
            waited = time.monotonic() - opening
            cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            timed_out = isinstance(cause, TimeoutError | av.error.FFmpegError)
            if timed_out and waited >= 0.9 * self.camera.stall_s:  # cut by the open timeout, however FFmpeg names it
                silent = f"no answer within {self.camera.stall_s:g} s"
                return f"{RECONNECT}: cannot open the stream: {silent} ({_describe(exc)})"
            return f"{RECONNECT}: cannot open the stream ({_describe(exc)})"
        seg: _Open | None = None
        why = ENDED
        try:
            if not container.streams.video:
                return f"{RECONNECT}: no video stream"
            src = container.streams.video[0]
            tb = src.time_base
            probe, shape = _KeyframeProbe(src), None
            for packet in container.demux(src):
                if self.stop.is_set():
                    why = STOPPED
                    break
                if packet.pts is None or packet.size == 0:
                    continue
                if packet.is_keyframe:  # a new resolution: a new segment, opened on the next connection
                    now = probe.shape(packet)
                    if now is None:
                        why = f"{RECONNECT}: a keyframe that does not decode"
                        break
                    if shape is not None and now != shape:
                        why = f"{RECONNECT}: the picture changed from {shape[0]}x{shape[1]} to {now[0]}x{now[1]}"
                        break
                    shape = now
                if seg is None:
                    if not packet.is_keyframe:
                        continue  # a segment starts on a keyframe: nothing before it decodes
                    seg = self._start(src, packet)
                    if self.health["status"] != RECORDING:
                        log.info("%s (%s): recording", self.camera.name, self.camera.redacted)
                        self._report(status=RECORDING, consecutive_failures=0)
                elif packet.is_keyframe and (packet.pts - seg.first_pts) * tb >= self.camera.segment_s:
                    self._finish(seg, tb, CUT)
                    seg = self._start(src, packet)
                elif packet.pts < seg.last_pts - 10 * max(1, seg.last_duration):
                    why = f"{RECONNECT}: timestamps went back"
                    break
                seg.last_pts, seg.last_duration = packet.pts, packet.duration or seg.last_duration
                self._write(seg, packet)
        except av.error.FFmpegError as exc:
            why = f"{RECONNECT}: {exc.__class__.__name__} while reading"
        except (OSError, http.client.HTTPException, Refused) as exc:  # HlsIO's, raised again by PyAV
            why = f"{RECONNECT}: {_describe(exc)}"
        except Exception as exc:  # never a crashed recorder: the next connection starts clean
            log.exception("%s: unexpected error while recording", self.camera.name)
            why = f"{RECONNECT}: {exc.__class__.__name__}"
        finally:
            if hls is not None and hls.error is not None and why != STOPPED:  # what FFmpeg saw as an end or a stall
                why = f"{RECONNECT}: {_describe(hls.error)}"
            if seg is not None:  # kept: valid up to its last packet; the next one says why it stopped here
                self._finish(seg, src.time_base, why)
            try:
                container.close()
            except Exception:
                pass
        return why

    def record(self, max_connects: int | None = None) -> None:
        """Connect, record, reconnect after a backoff with jitter, until ``stop`` (or ``max_connects``)."""
        backoff, failures = 1.0, 0
        self._report(status=CONNECTING)
        while not self.stop.is_set() and (max_connects is None or self.connects < max_connects):
            self.connects += 1
            before = self.segments
            why = self._session()
            if self.stop.is_set():
                break
            recorded = self.segments > before
            backoff = 1.0 if recorded else min(self.max_backoff_s, backoff * 2)
            failures = 0 if recorded else failures + 1
            delay = backoff * random.uniform(0.5, 1.0)
            name = f"{self.camera.name} ({self.camera.redacted})"
            if recorded:
                log.info("%s: %s; connecting again in %.1f s", name, why, delay)
            else:  # visible without any logging set up (Python's last-resort handler shows warnings)
                log.warning("%s: %s; %d failed attempt(s) in a row, next in %.1f s", name, why, failures, delay)
            error = why.removeprefix(f"{RECONNECT}: ")
            self._report(status=CONNECTING if recorded else FAILING, consecutive_failures=failures,
                         last_error=error, last_error_at=self.clock())  # fmt: skip
            self.stop.wait(delay)
        self._report(status=STOPPED)
        # a stop sets no gap reason: the next run of the recorder starts its own first segment


def record_all(
    cameras: list[Camera],
    folder_of: Callable[[str], Path],
    on_segment,
    stop: threading.Event,
    max_connects=None,
    env=None,
    on_health=None,
) -> list:
    """One thread per camera (a camera that fails never stops the others), each into ``folder_of(name)`` (the
    volume's ``VideoVolume.stream_folder``); returns when all are done (joins wake often: signals are seen)."""
    recorders = [Recorder(c, folder_of(c.name), on_segment, stop, env=env, on_health=on_health) for c in cameras]
    threads = [
        threading.Thread(target=r.record, kwargs={"max_connects": max_connects}, name=f"record-{r.camera.name}")
        for r in recorders
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)
    return recorders
