"""The words every stage shares: verdicts, statuses, routing destinations. Defined once here;
schemas, prompts, routing, scoring and table docs all read them from this module."""

from __future__ import annotations

from typing import Literal, get_args

# What a use case answers about a segment, most severe first.
Verdict = Literal["confirmed", "suspected", "possible", "none"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
# The binary decision a dashboard acts on: these verdicts raise an alert (above the threshold).
FLAGGED: frozenset[str] = frozenset({"confirmed", "suspected"})
SEVERITY: dict[str, int] = {v: len(VERDICTS) - 1 - i for i, v in enumerate(VERDICTS)}

# captions.status
CAPTION_OK, CAPTION_ERROR = "ok", "error"
CAPTION_STATUSES = (CAPTION_OK, CAPTION_ERROR)

# structured_events.status: decoded under the schema / verdict-only retry / still failed / no input
PARSED, RETRIED, UNPARSED, NO_CAPTION = "parsed", "retried", "unparsed", "no_caption"
STRUCTURE_STATUSES = (PARSED, RETRIED, UNPARSED, NO_CAPTION)
ANSWERED = (PARSED, RETRIED)

# transcripts.status: one name per outcome of a video's audio, with what it means (table docs read the meanings).
# Only TRANSCRIPT_SPEECH rows carry text; the others are the single row their video gets, segment = -1.
TRANSCRIPT_SPEECH, TRANSCRIPT_NO_AUDIO, TRANSCRIPT_NO_SPEECH, TRANSCRIPT_ERROR = (
    "speech",
    "no_audio",
    "no_speech",
    "error",
)
TRANSCRIPT_STATUSES: dict[str, str] = {
    TRANSCRIPT_SPEECH: "one transcribed speech segment, with its words and their times",
    TRANSCRIPT_NO_AUDIO: "the container has no audio stream",
    TRANSCRIPT_NO_SPEECH: "audio decoded, but no speech survived voice detection and the hallucination guard",
    TRANSCRIPT_ERROR: "the audio could not be opened or decoded; the reason is in error",
}

# frame_embeddings.status; text_embeddings.source.
EMBEDDED, EMBED_ERROR = "ok", "error"
EMBEDDING_STATUSES = (EMBEDDED, EMBED_ERROR)
SOURCE_TRANSCRIPT, SOURCE_CAPTION = "transcript", "caption"
EMBEDDING_SOURCES = (SOURCE_TRANSCRIPT, SOURCE_CAPTION)

# frames.reason: why a sampled frame was kept or dropped by curation (checked in this order).
CURATION_KEPT, CURATION_DARK, CURATION_WASHED_OUT, CURATION_FLAT = "kept", "dark", "washed_out", "flat"
CURATION_BLURRY, CURATION_STATIC, CURATION_DUPLICATE, CURATION_ERROR = "blurry", "static", "duplicate", "error"
CURATION_REASONS: dict[str, str] = {
    CURATION_KEPT: "passed every filter",
    CURATION_DARK: "mean luma under dark_max_brightness",
    CURATION_WASHED_OUT: "mean luma over washed_out_min_brightness",
    CURATION_FLAT: "luma standard deviation under min_contrast (an empty, uniform frame)",
    CURATION_BLURRY: "Laplacian variance under min_sharpness",
    CURATION_STATIC: "barely differs from the previous sampled frame (motion under min_motion)",
    CURATION_DUPLICATE: "perceptual hash within duplicate_max_distance of a frame kept earlier in the video",
    CURATION_ERROR: "the video's frames could not be decoded again; the reason is in error",
}

# Where a structured row is routed.
ALERTS, REVIEW_QUEUE = "alerts", "review_queue"


def doc(words) -> str:
    """``"a | b | c"``: the allowed values as written in table column docs."""
    return " | ".join(words)
