"""The audio track of a video as Whisper wants it: 16 kHz mono float32 samples, decoded in-process with PyAV.

A video without an audio stream is ``None`` (not an error: most surveillance footage has none). A
stream that breaks part way keeps what decoded before and after the damage and counts the packets
lost; one that decodes nothing raises ``TranscriptionError`` with a readable reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import numpy as np

from video_assets.core.media.source import open_container

WHISPER_RATE = 16000  # Whisper's feature extractor is built for 16 kHz


class TranscriptionError(Exception):
    """A video whose audio cannot be opened or decoded, with a readable reason."""


@dataclass
class AudioTrack:
    samples: np.ndarray  # float32, 1-D, mono, in [-1, 1]
    sample_rate: int
    duration_s: float  # of the decoded samples (not the container's claim)
    codec: str | None
    decode_errors: int = 0  # packets that failed to demux or decode; their audio is missing
    start_s: float = 0.0  # where the first decoded sample sits on the video's timeline


def _readable(exc: BaseException) -> str:
    text = str(exc).strip() or exc.__class__.__name__
    return f"{exc.__class__.__name__}: {text}"


def decode_audio(uri: str, sample_rate: int = WHISPER_RATE) -> AudioTrack | None:
    """The first audio stream of ``uri`` resampled to ``sample_rate`` mono float32; ``None`` when the
    container has no audio stream. Raises ``TranscriptionError`` when it cannot be opened or nothing decodes."""
    with open_container(uri, TranscriptionError) as container:
        streams = container.streams.audio
        if not streams:
            return None
        stream = streams[0]
        try:
            codec = stream.codec_context.name
        except (av.error.FFmpegError, AttributeError, ValueError) as exc:  # no decoder for this codec
            raise TranscriptionError(f"audio stream cannot be decoded: {_readable(exc)}") from exc
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
        chunks: list[np.ndarray] = []
        errors = 0
        last_error: BaseException | None = None
        first_time: float | None = None

        def take(frames) -> None:
            for out in frames:
                chunks.append(out.to_ndarray().reshape(-1))

        packets = container.demux(stream)
        while True:
            try:
                packet = next(packets)
            except StopIteration:
                break
            except (av.error.FFmpegError, OSError) as exc:  # the demuxer itself broke (cut file): nothing follows
                errors += 1
                last_error = exc
                break
            try:
                for frame in packet.decode():
                    if first_time is None and frame.time is not None:
                        first_time = frame.time
                    take(resampler.resample(frame))
            except (av.error.FFmpegError, ValueError) as exc:  # one bad packet: skip it, keep going
                errors += 1
                last_error = exc
        try:
            take(resampler.resample(None))  # flush: the resampler holds back its filter's tail
        except (av.error.FFmpegError, ValueError) as exc:
            errors += 1
            last_error = exc
        samples = np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)
        if samples.size == 0 and last_error is not None:
            raise TranscriptionError(f"audio stream ({codec}) decoded nothing: {_readable(last_error)}")
        # Times on the video's timeline: the container may start its clock above zero.
        origin = container.start_time / av.time_base if container.start_time is not None else 0.0
        start = max(0.0, (first_time or 0.0) - origin)
        return AudioTrack(
            samples=samples,
            sample_rate=sample_rate,
            duration_s=samples.size / sample_rate,
            codec=codec,
            decode_errors=errors,
            start_s=round(start, 4),
        )
