"""The embedding Ray Data jobs (shape in ``core.inference.stages``).

Frames: the CPU stage takes, per video, exactly the frames its captions saw (their JPEGs from
sampled_frames; for older captions, decoded again at the captions' ``frame_timestamps``), so a frame hit
and a caption hit name the same instant; the encoder actors embed them (and read on-screen text when OCR
is on). Texts: no CPU stage; encoder actors embed transcript segments and captions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.stages import StageSpec, columns, node_id, stream
from video_assets.core.media.frames import caption_frames_at
from video_assets.core.media.sampling import match_times
from video_assets.core.vocabulary import EMBED_ERROR, EMBEDDED

EFFICIENTNET_LITE0 = "efficientnet-lite0"  # model_type of the bundled encoder's config.json


def load_frame_encoder(model_dir: str | Path, device: str = "cpu"):
    """The frame encoder in a registered model folder: the bundled EfficientNet-Lite0 (its config.json
    names the weights file), else a CLIP-style image+text model."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") == EFFICIENTNET_LITE0:
        from video_assets.core.embeddings.frames import EfficientNetLiteEncoder

        return EfficientNetLiteEncoder(weights=model_dir / config["weights"], device=device)
    from video_assets.core.embeddings.frames import frame_encoder

    return frame_encoder(str(model_dir), model_dir, device)


def decode_caption_frames(row: dict) -> list[dict]:
    """CPU stage: one video's caption frames (``times``: segment -> frame times; ``caption_frames_at``);
    one row per segment, or one row with ``error`` when nothing decodes."""
    started = time.perf_counter()
    ids = {k: row[k] for k in ("video_id", "batch_key", "uri")}
    segments = json.loads(row["times"])
    try:
        found, frames, _ = caption_frames_at(row, [t for ts in segments.values() for t in ts])
    except Exception as exc:  # one bad video is an error row, never a failed job
        return [
            {**ids, "segment": 0, "timestamps": [], "frames": np.zeros((0, 1, 1, 3), np.uint8)} | _err(exc, started)
        ]
    out = []
    for segment, ts in sorted(segments.items(), key=lambda kv: int(kv[0])):
        matched = [(t, i) for t, i in zip(ts, match_times(found, ts)) if i is not None]
        keep, picks = [t for t, _ in matched], [i for _, i in matched]
        out.append(
            {**ids, "segment": int(segment), "timestamps": keep, "frames": frames[picks] if picks else frames[:0]}
            | {"error": "", "decode_s": (time.perf_counter() - started) / max(1, len(segments))}
        )
    return out


def _err(exc: BaseException, started: float) -> dict:
    return {"error": f"{exc.__class__.__name__}: {exc}", "decode_s": time.perf_counter() - started}


class FrameStage:
    """One frame encoder (and OCR reader, when on) per actor; a call embeds a batch of segments' frames."""

    def __init__(self, model: ModelFiles, device: str, ocr: bool, batch_size: int):
        self.encoder = load_frame_encoder(model.here(), device)
        self.ocr = None
        if ocr:
            from video_assets.core.embeddings.ocr import FrameOcr

            self.ocr = FrameOcr()
        self.batch_size = batch_size
        self.node = node_id()

    def __call__(self, batch: dict) -> dict:
        rows = []
        for i in range(len(batch["video_id"])):
            ids = {k: str(batch[k][i]) for k in ("video_id", "batch_key", "uri")}
            error = batch["error"][i] if isinstance(batch["error"][i], str) else ""
            frames, stamps = batch["frames"][i], list(batch["timestamps"][i])
            base = {**ids, "segment": int(batch["segment"][i]), "decode_s": float(batch["decode_s"][i])}
            if error or not len(stamps):
                reason = error or "no frame of the caption decoded again"
                rows.append(base | {"frame": 0, "timestamp_s": None, "status": EMBED_ERROR, "error": reason} | _none())
                continue
            started = time.perf_counter()
            vectors = np.concatenate(
                [
                    self.encoder.encode_images(list(frames[j : j + self.batch_size]))
                    for j in range(0, len(frames), self.batch_size)
                ]
            )
            texts = [self.ocr.text(f) for f in frames] if self.ocr is not None else [None] * len(stamps)
            per_frame = (time.perf_counter() - started) / len(stamps)
            for j, (t, vec, text) in enumerate(zip(stamps, vectors, texts)):
                rows.append(
                    base
                    | {"frame": j, "timestamp_s": float(t), "status": EMBEDDED, "error": None}
                    | {"dim": int(vec.shape[0]), "embedding": vec.astype(np.float32).tolist(), "ocr_text": text}
                    | {"encode_s": per_frame, "node": self.node}
                )
        return columns(rows)


def _none() -> dict:
    return {"dim": None, "embedding": None, "ocr_text": None, "encode_s": 0.0, "node": ""}


def frame_embedding_rows(
    videos: list[dict], model: ModelFiles, device: str, ocr: bool, batch_size: int, spec: StageSpec
):
    """``videos``: video_id, batch_key, uri, rotation, times (JSON: segment -> caption frame times)."""
    return stream(
        videos,
        decode_caption_frames,
        {},
        FrameStage,
        {"model": model, "device": device, "ocr": ocr, "batch_size": batch_size},
        spec,
    )


class TextStage:
    """One text encoder per actor; a call embeds a batch of texts."""

    def __init__(self, model: ModelFiles, device: str):
        from video_assets.core.embeddings.text import TextEncoder

        self.encoder = TextEncoder(model.here(), device=device)
        self.node = node_id()

    def __call__(self, batch: dict) -> dict:
        started = time.perf_counter()
        vectors = self.encoder.encode([str(t) for t in batch["text"]])
        out = {k: list(v) for k, v in batch.items()}
        out["dim"] = [int(vectors.shape[1])] * len(vectors)
        out["embedding"] = [v.astype(np.float32).tolist() for v in vectors]
        out["encode_s"] = [(time.perf_counter() - started) / max(1, len(vectors))] * len(vectors)
        return out


def text_embedding_rows(texts: list[dict], model: ModelFiles, device: str, spec: StageSpec):
    """``texts``: rows with a ``text`` column (and whatever keys them); the same rows come back with
    ``dim``, ``embedding`` and ``encode_s``."""
    return stream(texts, None, {}, TextStage, {"model": model, "device": device}, spec)
