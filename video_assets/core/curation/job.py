"""The curation Ray Data job (shape in ``core.inference.stages``).

The CPU stage takes, per video, exactly the frames its captions saw (their JPEGs from sampled_frames; for
older captions, decoded again at the captions' ``frame_timestamps``: ``frames.caption_frames_at``), scores
and judges them (``quality.curate``, over the whole video in time order, so duplicates are found across
segments) and encodes each kept frame, cropped to its picture, as JPEG. With descriptions on, a pool of VLM
actors (the captioning engine interface) describes every kept frame as a one-frame request; otherwise
there is no model stage.
"""

from __future__ import annotations

import io
import json
import math
import time

import numpy as np

from video_assets.core.captioning.job import EngineSpec, build_engine
from video_assets.core.curation.quality import CurationConfig, crop, curate
from video_assets.core.inference.stages import StageSpec, columns, node_id, stream
from video_assets.core.media.frames import caption_frames_at, encode_one
from video_assets.core.media.sampling import match_times
from video_assets.core.vocabulary import CURATION_ERROR

DEFAULT_DESCRIBE_PROMPT = "Describe the action of both hands in 20 words."

# The columns of a curated frame row, in order (what the CPU stage emits and the model stage hands on).
ROW_COLUMNS = (
    "video_id",
    "batch_key",
    "uri",
    "segment",
    "frame",
    "timestamp_s",
    "kept",
    "reason",
    "sharpness",
    "brightness",
    "contrast",
    "motion",
    "crop_x0",
    "crop_y0",
    "crop_x1",
    "crop_y1",
    "width",
    "height",
    "phash",
    "image",
    "description",
    "error",
    "decode_s",
    "thumb",  # a small JPEG of the whole frame (kept or not) for the contact sheet; not stored
)
THUMB_HEIGHT = 72


def decode_and_curate(row: dict, config: CurationConfig) -> list[dict]:
    """CPU stage: one video (``times``: JSON segment -> caption frame times) in, one row per caption
    frame out; frames that do not decode again are ``error`` rows (all of them when the video fails)."""
    started = time.perf_counter()
    ids = {k: row[k] for k in ("video_id", "batch_key", "uri")}
    segments = {int(k): list(v) for k, v in json.loads(row["times"]).items()}
    wanted = [(seg, j, float(t)) for seg, ts in sorted(segments.items()) for j, t in enumerate(ts)]
    try:
        found, frames, _ = caption_frames_at(row, [t for _, _, t in wanted])
        error = ""
    except Exception as exc:  # one bad video is error rows, never a failed job
        found, frames, error = [], np.zeros((0, 1, 1, 3), np.uint8), f"{exc.__class__.__name__}: {exc}"
    verdicts = curate(frames, found, config) if len(found) else []
    decode_s = (time.perf_counter() - started) / max(1, len(wanted))
    out = []
    for (seg, j, t), i in zip(wanted, match_times(found, [t for _, _, t in wanted])):
        base = {**ids, "segment": seg, "frame": j, "timestamp_s": t, "description": None, "decode_s": decode_s}
        if i is None:
            why = error or "the frame did not decode again"
            out.append(base | _error_scores() | {"reason": CURATION_ERROR, "error": why, "thumb": None})
            continue
        v = verdicts[i]
        x0, y0, x1, y1 = v.crop
        out.append(
            base
            | {"kept": v.kept, "reason": v.reason, "sharpness": v.sharpness, "brightness": v.brightness}
            | {"contrast": v.contrast, "motion": v.motion, "phash": v.phash, "error": ""}
            | {"crop_x0": x0, "crop_y0": y0, "crop_x1": x1, "crop_y1": y1}
            | {"width": int(frames.shape[2]), "height": int(frames.shape[1])}
            | {"image": encode_one(crop(frames[i], v.crop), config.jpeg_quality) if v.kept else None}
            | {"thumb": _thumb(frames[i])}
        )
    return out


def _thumb(frame: np.ndarray) -> bytes:
    from PIL import Image

    im = Image.fromarray(frame)
    im = im.resize((max(1, round(im.width * THUMB_HEIGHT / im.height)), THUMB_HEIGHT))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=70)
    return buf.getvalue()


def _error_scores() -> dict:
    none = dict.fromkeys(("sharpness", "brightness", "contrast", "motion", "phash", "image"))
    crop_box = dict.fromkeys(("crop_x0", "crop_y0", "crop_x1", "crop_y1", "width", "height"))
    return {"kept": False, **none, **crop_box}


def decode_image(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class DescribeStage:
    """One VLM engine per actor, or (``endpoint``) the OpenAI route the actor sends to; a call describes the
    kept frames of a batch of frame rows (one-frame requests on the captioning engine interface) and hands
    every row on."""

    def __init__(self, engine: EngineSpec, prompt: str, endpoint: dict | None = None):
        if endpoint:  # an endpoint (VLM_ENGINE=endpoint, or the served caption model's route) describes, as it captions
            from video_assets.core.captioning.endpoint_engine import EndpointEngine

            self.engine = EndpointEngine(endpoint)
        else:
            self.engine = build_engine(engine)
        self.prompt = prompt
        self.max_new_tokens = engine.max_new_tokens
        self.node = node_id()

    def __call__(self, batch: dict) -> dict:
        from video_assets.core.captioning.requests import CaptionRequest

        n = len(batch["video_id"])
        rows = [{k: _plain(batch[k][i]) for k in ROW_COLUMNS} for i in range(n)]
        requests = {
            i: CaptionRequest(
                request_id=f"{r['video_id']}:{r['segment']}:{r['frame']}",
                frames=decode_image(r["image"])[None],
                timestamps=[float(r["timestamp_s"])],
                prompt=self.prompt,
                max_new_tokens=self.max_new_tokens,
            )
            for i, r in enumerate(rows)
            if r["kept"] and r["image"]
        }
        responses = self.engine.generate(list(requests.values())) if requests else []
        for i, resp in zip(requests, responses):
            rows[i]["description"] = resp.text if not resp.error else None
            if resp.error:
                rows[i]["error"] = f"description failed: {resp.error}"
        return columns(rows)


def _plain(value):
    """A Ray batch value as a plain Python value (NaN, which a column of Nones may become, as None)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def curated_rows(
    videos: list[dict],
    config: CurationConfig,
    spec: StageSpec,
    engine: EngineSpec | None = None,
    prompt: str = DEFAULT_DESCRIBE_PROMPT,
    endpoint: dict | None = None,
):
    """``videos``: video_id, batch_key, uri, rotation, times (JSON: segment -> caption frame times).
    Yields one row (``ROW_COLUMNS``) per caption frame; ``engine`` set: kept frames get a description,
    from ``endpoint`` (``Endpoint`` fields: an endpoint, or the served caption model's route) when given,
    else from an engine loaded per actor."""
    if engine is None:
        return stream(videos, decode_and_curate, {"config": config}, None, {}, spec)
    kwargs = {"engine": engine, "prompt": prompt, "endpoint": endpoint}
    return stream(videos, decode_and_curate, {"config": config}, DescribeStage, kwargs, spec)
