"""Benchmark section: throughput of the archive stages' models on the corpus, each against the time of
what it processes, in the same run (models loaded once first: load time is start-up, reported apart).

- transcription: Whisper base (int8, VAD) over every clip with audio, vs the audio's duration (real time);
- frame embeddings: EfficientNet-Lite0 over the frames the default sampler picks, vs decoding them;
- text embeddings: all-MiniLM-L6-v2 over the golden set's reference captions, vs the issue's figure
  (350 sentences/s measured on this kind of machine).
"""

from __future__ import annotations

import json
import pathlib
import time

from resources.archive import FRAMES, SPEECH, TEXT, assemble_packaged

GOLDEN = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "object_handling.jsonl"
BUNDLED_GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "video_assets" / "usecases" / "object_handling"


SPOKEN = [
    "A person walks into the shop and picks up a green bottle from the second shelf.",
    "She reads the label, puts the bottle back and takes a smaller one instead.",
    "At the counter the clerk scans the bottle and asks whether she needs a bag.",
    "She pays with a card, thanks the clerk and leaves through the side door.",
] * 3


def rows(clips: list[pathlib.Path], work: pathlib.Path) -> list[dict]:
    out = [_speech(clips, work, "corpus clips with audio (no speech in them)")]
    spoken = _spoken_clip(work)
    if spoken is not None:
        out.append(_speech([spoken], work, "generated speech (espeak-ng)"))
    return out + [_frames(clips, work), _text(work)]


def _spoken_clip(work: pathlib.Path) -> pathlib.Path | None:
    """About 50 s of espeak-ng speech muxed under sample frames (the speech tests' clip, longer)."""
    import shutil

    if not shutil.which("espeak-ng"):
        return None
    from tests.fixtures.speech import speech_clip

    path = work / "spoken.mp4"
    if not path.exists():
        speech_clip(path, SPOKEN, lead_s=1.0)
    return path


def _speech(clips, work, what: str) -> dict:
    from video_assets.core.transcription.audio import decode_audio
    from video_assets.core.transcription.whisper import Transcriber

    started = time.perf_counter()
    transcriber = Transcriber(assemble_packaged(SPEECH, work / "models" / "whisper-base"))
    load_s = time.perf_counter() - started
    audio_s = busy_s = decode_s = 0.0
    n = segments = 0
    for clip in clips:
        t = time.perf_counter()
        try:
            track = decode_audio(str(clip))
        except Exception:
            continue
        decode_s += time.perf_counter() - t
        if track is None or track.duration_s <= 0:
            continue
        t = time.perf_counter()
        segments += len(transcriber.transcribe(track).segments)
        busy_s += time.perf_counter() - t
        audio_s += track.duration_s
        n += 1
    return {
        "measurement": f"transcribe {what}: {n} clips, {audio_s:.0f} s of audio",
        "ours_s": busy_s,
        "baseline": "the audio's duration (real time)",
        "baseline_s": audio_s,
        "ratio": audio_s / busy_s if busy_s else 0.0,
        "target": "issue: 0.1-0.15x real time (6.7-10x)",
        "note": f"real-time factor {busy_s / audio_s:.3f}; {segments} speech segments; audio decode "
        f"{decode_s:.2f} s; model load {load_s:.1f} s",
    }


def _frames(clips, work) -> dict:
    import numpy as np

    from video_assets.core.embeddings.job import load_frame_encoder
    from video_assets.core.media.sampling import SamplingConfig, sample_video

    encoder = load_frame_encoder(assemble_packaged(FRAMES, work / "models" / "efficientnet-lite0"))
    encoder.encode_images([np.zeros((224, 224, 3), np.uint8)])  # first call: lazy init, not throughput
    decode_s = encode_s = 0.0
    frames = 0
    for clip in clips:
        t = time.perf_counter()
        try:
            sampled = sample_video(str(clip), SamplingConfig(max_frames=16))
        except Exception:
            continue
        decode_s += time.perf_counter() - t
        for seg in sampled.segments:
            if len(seg.frames):
                t = time.perf_counter()
                encoder.encode_images(seg.frames)
                encode_s += time.perf_counter() - t
                frames += len(seg.frames)
    return {
        "measurement": f"embed {frames} sampled frames (EfficientNet-Lite0)",
        "ours_s": encode_s,
        "baseline": "decoding those frames (sampler)",
        "baseline_s": decode_s,
        "ratio": decode_s / encode_s if encode_s else 0.0,
        "target": "issue: about 50 ms a frame",
        "note": f"{1000 * encode_s / max(1, frames):.0f} ms a frame, {frames / encode_s:.1f} frames/s; "
        f"decode {1000 * decode_s / max(1, frames):.0f} ms a frame",
    }


def _text(work) -> dict:
    from video_assets.core.embeddings.text import TextEncoder

    path = GOLDEN if GOLDEN.exists() else BUNDLED_GOLDEN / "golden.jsonl"
    captions = [json.loads(line).get("reference_caption") or "" for line in path.read_text().splitlines() if line]
    sentences = [s.strip() for c in captions for s in c.replace(";", ".").split(".") if s.strip()] * 4
    encoder = TextEncoder(assemble_packaged(TEXT, work / "models" / "all-MiniLM-L6-v2"))
    encoder.encode(sentences[:8])  # warm-up
    t = time.perf_counter()
    encoder.encode(sentences)
    took = time.perf_counter() - t
    reference = len(sentences) / 350.0  # the 350 sentences/s
    return {
        "measurement": f"embed {len(sentences)} caption sentences (MiniLM)",
        "ours_s": took,
        "baseline": "issue's 350 sentences/s",
        "baseline_s": reference,
        "ratio": reference / took if took else 0.0,
        "target": ">= 1 (350 sentences/s)",
        "note": f"{len(sentences) / took:.0f} sentences/s",
    }
