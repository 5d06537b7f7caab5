"""The transcription Ray Data job (shape in ``core.inference.stages``): 1-CPU tasks decode each video's
audio to 16 kHz mono; Whisper actors (CPU or GPU) transcribe it into the rows of ``transcript_rows``."""

from __future__ import annotations

import time

import numpy as np

from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.stages import StageSpec, columns, node_id, stream
from video_assets.core.transcription.audio import AudioTrack, TranscriptionError, decode_audio

NO_SAMPLES = np.zeros(0, np.float32)


def decode_audio_row(row: dict) -> list[dict]:
    """CPU stage: one video's audio, or why there is none (``audio``: ok | none | error)."""
    started = time.perf_counter()
    ids = {k: row[k] for k in ("video_id", "batch_key", "uri")}
    try:
        track = decode_audio(row["uri"])
    except (TranscriptionError, OSError) as exc:
        return [{**ids, "audio": "error", "error": str(exc), "samples": NO_SAMPLES} | _track_fields(None, started)]
    if track is None:
        return [{**ids, "audio": "none", "error": "", "samples": NO_SAMPLES} | _track_fields(None, started)]
    return [{**ids, "audio": "ok", "error": "", "samples": track.samples} | _track_fields(track, started)]


def _track_fields(track: AudioTrack | None, started: float) -> dict:
    return {
        "sample_rate": track.sample_rate if track else 16000,
        "duration_s": float(track.duration_s) if track else 0.0,
        "codec": (track.codec or "") if track else "",
        "decode_errors": int(track.decode_errors) if track else 0,
        "start_s": float(track.start_s) if track else 0.0,
        "decode_s": time.perf_counter() - started,
    }


class TranscribeStage:
    """One Whisper model per actor, loaded once per job; a call transcribes a batch of videos."""

    def __init__(self, model: ModelFiles, settings: dict, model_name: str, model_version: str):
        from video_assets.core.transcription.whisper import Transcriber

        self.transcriber = Transcriber(model.here(), **settings)
        self.model_name, self.model_version = model_name, model_version
        self.node = node_id()

    def __call__(self, batch: dict) -> dict:
        from video_assets.core.transcription.whisper import transcript_rows

        out = []
        for i in range(len(batch["video_id"])):
            video = {k: str(batch[k][i]) for k in ("video_id", "batch_key", "uri")}
            audio, error = str(batch["audio"][i]), batch["error"][i]
            started = time.perf_counter()
            if audio == "error":
                rows = transcript_rows(video, None, str(error), self.model_name, self.model_version)
            elif audio == "none":
                rows = transcript_rows(video, None, None, self.model_name, self.model_version)
            else:
                track = AudioTrack(
                    samples=np.asarray(batch["samples"][i], dtype=np.float32),
                    sample_rate=int(batch["sample_rate"][i]),
                    duration_s=float(batch["duration_s"][i]),
                    codec=str(batch["codec"][i]) or None,
                    decode_errors=int(batch["decode_errors"][i]),
                    start_s=float(batch["start_s"][i]),
                )
                rows = transcript_rows(
                    video, self.transcriber.transcribe(track), None, self.model_name, self.model_version
                )
            extra = {
                "audio_s": float(batch["duration_s"][i]),
                "decode_s": float(batch["decode_s"][i]),
                "transcribe_s": time.perf_counter() - started,
                "segments_of_video": len(rows),
                "node": self.node,
            }
            # Words travel as one JSON string: a nested list that is empty on some rows does not
            # survive Ray's batch conversion reliably.
            out += [{**r, "words": _json(r["words"]), **extra} for r in rows]
        return columns(out)


def _json(value) -> str:
    import json

    return json.dumps(value)


def transcript_job_rows(
    videos: list[dict], model: ModelFiles, settings: dict, model_name: str, model_version: str, spec: StageSpec
):
    """``videos``: video_id, batch_key, uri. Yields transcript rows (``words`` as JSON) with per-video
    timings (``audio_s``, ``decode_s``, ``transcribe_s``) and ``segments_of_video``."""
    return stream(
        videos,
        decode_audio_row,
        {},
        TranscribeStage,
        {"model": model, "settings": settings, "model_name": model_name, "model_version": model_version},
        spec,
    )
