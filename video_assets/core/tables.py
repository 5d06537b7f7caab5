"""One schema per table, declared once: used by the writers, the column-schema metadata and the tests."""

from __future__ import annotations

import pyarrow as pa

from video_assets.core.vocabulary import (
    CAPTION_STATUSES,
    CURATION_REASONS,
    EMBEDDING_SOURCES,
    EMBEDDING_STATUSES,
    STRUCTURE_STATUSES,
    TRANSCRIPT_STATUSES,
    VERDICTS,
    doc,
)

_TS = pa.timestamp("us", tz="UTC")

BATCH_MANIFEST = "batch_manifest"
RAW_VIDEOS = "raw_videos"
VIDEO_METADATA = "video_metadata"
CAPTIONS = "captions"
GOLDEN_SET = "golden_set"
STRUCTURED_EVENTS = "structured_events"
ALERTS = "alerts"
REVIEW_QUEUE = "review_queue"
EVAL_SCORES = "eval_scores"
PROMOTIONS = "promotion_decisions"
TRANSCRIPTS = "transcripts"
FRAME_EMBEDDINGS = "frame_embeddings"
TEXT_EMBEDDINGS = "text_embeddings"
VIDEO_SUMMARIES = "video_summaries"
CURATED_FRAMES = "frames"
SAMPLED_FRAMES = "sampled_frames"
REVIEW_LABELS = "review_labels"
PROMOTION_DIFFS = "promotion_diffs"
STREAM_SEGMENTS = "stream_segments"
ALERT_DELIVERIES = "alert_deliveries"
CAMERA_HEALTH = "camera_health"
# What the promotion job makes to judge a challenger against production on a golden set: tables of their
# own (the captions, structured_events and eval_scores schemas), so the pipeline's tables hold only what
# their own assets wrote.
CANDIDATE_CAPTIONS = "candidate_captions"
CANDIDATE_EVENTS = "candidate_events"
CANDIDATE_SCORES = "candidate_scores"

# The scores every evaluation reports as columns (all of them are in the metrics JSON too).
HEADLINE_METRICS = {
    "flagged_precision": "precision of flagged (confirmed + suspected) vs not",
    "flagged_recall": "recall of flagged",
    "flagged_f1": "F1 of flagged",
    "flagged_f1_ci_low": "bootstrap 95% CI of flagged F1, low",
    "flagged_f1_ci_high": "bootstrap 95% CI of flagged F1, high",
    "macro_f1": "mean F1 over the four verdicts",
    "accuracy": "verdict accuracy",
    "event_precision": "event precision (temporal IoU matching)",
    "event_recall": "event recall",
    "event_f1": "event F1",
    "mean_iou": "mean IoU of matched events",
    "coverage": "share of scored videos with a parsed or retried verdict",
}

_EVENT = pa.struct(
    [
        ("start_s", pa.float64()),
        ("end_s", pa.float64()),
        ("actor", pa.string()),
        ("action", pa.string()),
        ("object", pa.string()),
    ]
)
# The identity of one structuring of one caption: which caption (video, segment, caption model and
# prompt) and which structuring (use case + its version, structuring model).
_STRUCT_KEY = [
    pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
    pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "clip index within the video"}),
    pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "use case (video_assets/usecases/<name>)"}),
    pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "MLflow version of the captioning model"}),
    pa.field("prompt_version", pa.int32(), nullable=False, metadata={"doc": "MLflow version of the caption prompt"}),
    pa.field(
        "use_case_version", pa.string(), nullable=False, metadata={"doc": "hash of the use case's prompt and config"}
    ),
    pa.field("structurer", pa.string(), nullable=False, metadata={"doc": "model that structured the prose"}),
]
_CAPTION_DIGEST = pa.field(
    "caption_digest",
    pa.string(),
    metadata={"doc": "digest of the caption row the row was made from (core/captioning/versions.py)"},
)
_ROUTED = _STRUCT_KEY + [
    pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
    pa.field("uri", pa.string(), nullable=False, metadata={"doc": "the video"}),
    _CAPTION_DIGEST,
    pa.field("start_s", pa.float64(), metadata={"doc": "evidence start: first event, else the segment start"}),
    pa.field("end_s", pa.float64(), metadata={"doc": "evidence end: last event, else the segment end"}),
    pa.field("verdict", pa.string(), metadata={"doc": f"{doc(VERDICTS)}; null if unparsed"}),
    pa.field("confidence", pa.float64(), metadata={"doc": "model confidence 0-1; null after a retry"}),
    pa.field("events", pa.list_(_EVENT), metadata={"doc": "events of the row"}),
    pa.field("reason", pa.string(), nullable=False, metadata={"doc": "why the row was routed here"}),
    pa.field("excerpt", pa.string(), metadata={"doc": "first 300 characters of the caption"}),
    pa.field("threshold", pa.float64(), nullable=False, metadata={"doc": "alert threshold in force"}),
    pa.field("routed_at", _TS, nullable=False, metadata={"doc": "when routed"}),
]

# A camera's segment: each routed row in the camera's own time (core.routing.wall_clock); null otherwise.
_CAMERA_TIME = [
    pa.field("camera", pa.string(), metadata={"doc": "the camera, when the video is a stream segment"}),
    pa.field(
        "wall_start",
        _TS,
        metadata={"doc": "evidence start by the camera's clock (segment start + start_s; no times: the segment's)"},
    ),
    pa.field("wall_end", _TS, metadata={"doc": "evidence end by the camera's clock"}),
    pa.field(
        "detected_after_s",
        pa.float64(),
        metadata={"doc": "seconds from the evidence's wall-clock start to this routed row"},
    ),
]

SCHEMAS: dict[str, pa.Schema] = {
    BATCH_MANIFEST: pa.schema(
        [
            pa.field("uri", pa.string(), nullable=False, metadata={"doc": "file as listed in the volume"}),
            pa.field("size_bytes", pa.int64(), nullable=False, metadata={"doc": "size when discovered"}),
            pa.field("mtime", _TS, nullable=False, metadata={"doc": "modification time when discovered"}),
            pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
            pa.field("status", pa.string(), nullable=False, metadata={"doc": "batched | duplicate"}),
            pa.field("batch_key", pa.string(), metadata={"doc": "partition of video_batches; null for duplicates"}),
            pa.field("duplicate_of", pa.string(), metadata={"doc": "uri already holding the same bytes"}),
            pa.field("discovered_at", _TS, nullable=False, metadata={"doc": "when the sensor or CLI saw it"}),
        ]
    ),
    RAW_VIDEOS: pa.schema(
        [
            pa.field(
                "video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes (stable across renames)"}
            ),
            pa.field("uri", pa.string(), nullable=False, metadata={"doc": "where the bytes were registered from"}),
            pa.field("size_bytes", pa.int64(), nullable=False, metadata={"doc": "file size"}),
            pa.field("mtime", _TS, nullable=False, metadata={"doc": "file modification time"}),
            pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
            pa.field("registered_at", _TS, nullable=False, metadata={"doc": "first registration time"}),
        ]
    ),
    VIDEO_METADATA: pa.schema(
        [
            pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
            pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
            pa.field("uri", pa.string(), nullable=False, metadata={"doc": "file probed"}),
            pa.field("ok", pa.bool_(), nullable=False, metadata={"doc": "true when a video frame decodes"}),
            pa.field("error", pa.string(), metadata={"doc": "why ok is false"}),
            pa.field("container", pa.string(), metadata={"doc": "demuxer name"}),
            pa.field("video_codec", pa.string(), metadata={"doc": "codec of the first video stream"}),
            pa.field("width", pa.int32(), metadata={"doc": "coded width in pixels (before rotation)"}),
            pa.field("height", pa.int32(), metadata={"doc": "coded height in pixels (before rotation)"}),
            pa.field("rotation", pa.int32(), metadata={"doc": "display rotation in degrees from the display matrix"}),
            pa.field(
                "avg_fps",
                pa.float64(),
                metadata={"doc": "average frame rate, from packet times when they disagree with the header"},
            ),
            pa.field("real_fps", pa.float64(), metadata={"doc": "real base frame rate (r_frame_rate)"}),
            pa.field("duration_s", pa.float64(), metadata={"doc": "duration in seconds"}),
            pa.field("duration_estimated", pa.bool_(), metadata={"doc": "true when computed from packets, not stored"}),
            pa.field(
                "frame_count",
                pa.int64(),
                metadata={
                    "doc": "frames, from the container index or the packets (not a header claim they contradict)"
                },
            ),
            pa.field("keyframe_interval_s", pa.float64(), metadata={"doc": "mean seconds between keyframes (sampled)"}),
            pa.field("audio_codec", pa.string(), metadata={"doc": "codec of the first audio stream, if any"}),
            pa.field("bit_rate", pa.int64(), metadata={"doc": "container bit rate in bit/s"}),
            pa.field("probed_at", _TS, nullable=False, metadata={"doc": "when probed"}),
        ]
    ),
    CAPTIONS: pa.schema(
        [
            pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
            pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
            pa.field("uri", pa.string(), nullable=False, metadata={"doc": "file captioned"}),
            pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "clip index within the video"}),
            pa.field("segment_start_s", pa.float64(), metadata={"doc": "clip start in the video, seconds"}),
            pa.field("segment_end_s", pa.float64(), metadata={"doc": "clip end in the video, seconds"}),
            pa.field("frame_timestamps", pa.list_(pa.float64()), metadata={"doc": "times of the frames the model saw"}),
            pa.field("prose", pa.string(), metadata={"doc": "the model's timestamped description"}),
            pa.field("model_name", pa.string(), nullable=False, metadata={"doc": "MLflow registered model"}),
            pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "MLflow model version"}),
            pa.field("prompt_version", pa.int32(), nullable=False, metadata={"doc": "MLflow prompt version"}),
            pa.field("engine", pa.string(), nullable=False, metadata={"doc": "transformers | vllm"}),
            pa.field("input_tokens", pa.int32(), metadata={"doc": "prompt tokens incl. vision tokens"}),
            pa.field("output_tokens", pa.int32(), metadata={"doc": "generated tokens"}),
            pa.field("latency_s", pa.float64(), metadata={"doc": "engine latency of the request"}),
            pa.field("decode_s", pa.float64(), metadata={"doc": "CPU-stage seconds (decode + sample)"}),
            pa.field("status", pa.string(), nullable=False, metadata={"doc": doc(CAPTION_STATUSES)}),
            pa.field("error", pa.string(), metadata={"doc": "why status is error"}),
            pa.field(
                "segments",
                pa.int32(),
                metadata={"doc": "segments planned for the video: it is complete when it has this many ok rows"},
            ),
            pa.field("split", pa.string(), metadata={"doc": "how the video was split (segment_s, scene_split)"}),
            pa.field("captioned_at", _TS, nullable=False, metadata={"doc": "when written"}),
        ]
    ),
    GOLDEN_SET: pa.schema(
        [
            pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "use case the labels belong to"}),
            pa.field(
                "labels_version", pa.string(), nullable=False, metadata={"doc": "sha256 prefix of the labels file"}
            ),
            pa.field("file", pa.string(), nullable=False, metadata={"doc": "file name of the labelled clip"}),
            pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the clip's bytes"}),
            pa.field("verdict", pa.string(), nullable=False, metadata={"doc": doc(VERDICTS)}),
            pa.field(
                "events",
                pa.list_(
                    pa.struct(
                        [
                            ("start_s", pa.float64()),
                            ("end_s", pa.float64()),
                            ("actor", pa.string()),
                            ("action", pa.string()),
                            ("object", pa.string()),
                        ]
                    )
                ),
                metadata={"doc": "expected events"},
            ),
            pa.field("reference_caption", pa.string(), metadata={"doc": "a person's timestamped description"}),
            pa.field("source", pa.string(), metadata={"doc": "shipped (the use case's golden.jsonl) | reviewed"}),
            pa.field(
                "replaces_shipped",
                pa.bool_(),
                metadata={"doc": "a reviewed label that replaces the shipped label of the same clip"},
            ),
            pa.field("reviewed_by", pa.string(), metadata={"doc": "reviewer of a reviewed label"}),
            pa.field("label_id", pa.string(), metadata={"doc": "review_labels row of a reviewed label"}),
            pa.field(
                "conflicts",
                pa.string(),
                metadata={"doc": "JSON: other labels of the clip that disagree with this one (null: none)"},
            ),
        ]
    ),
    STRUCTURED_EVENTS: pa.schema(
        _STRUCT_KEY
        + [
            pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
            pa.field("uri", pa.string(), nullable=False, metadata={"doc": "the video"}),
            pa.field("segment_start_s", pa.float64(), metadata={"doc": "clip start, seconds"}),
            pa.field("segment_end_s", pa.float64(), metadata={"doc": "clip end, seconds"}),
            _CAPTION_DIGEST,
            pa.field("status", pa.string(), nullable=False, metadata={"doc": doc(STRUCTURE_STATUSES)}),
            pa.field("verdict", pa.string(), metadata={"doc": doc(VERDICTS)}),
            pa.field("confidence", pa.float64(), metadata={"doc": "0-1; null when only the retry answered"}),
            pa.field("events", pa.list_(_EVENT), metadata={"doc": "timed events (start/end seconds in the video)"}),
            pa.field("n_events", pa.int32(), nullable=False, metadata={"doc": "len(events)"}),
            pa.field("rationale", pa.string(), metadata={"doc": "the model's short reason"}),
            pa.field("raw_output", pa.string(), metadata={"doc": "first-pass output, kept for audit"}),
            pa.field("retry_output", pa.string(), metadata={"doc": "the retry's output, if any"}),
            pa.field("error", pa.string(), metadata={"doc": "why a pass failed"}),
            pa.field("attempts", pa.int32(), nullable=False, metadata={"doc": "model calls made (0-2)"}),
            pa.field(
                "events_outside",
                pa.int32(),
                metadata={"doc": "events the model placed outside the clip, dropped (error says which)"},
            ),
            pa.field("output_tokens", pa.int32(), metadata={"doc": "tokens generated over all attempts"}),
            pa.field("latency_s", pa.float64(), metadata={"doc": "engine seconds over all attempts"}),
            pa.field("structured_at", _TS, nullable=False, metadata={"doc": "when written"}),
        ]
    ),
    ALERTS: pa.schema(_ROUTED + _CAMERA_TIME),
    REVIEW_QUEUE: pa.schema(_ROUTED + _CAMERA_TIME),
    EVAL_SCORES: pa.schema(
        [
            pa.field("eval_id", pa.string(), nullable=False, metadata={"doc": "unique id of the evaluation"}),
            pa.field("evaluated_at", _TS, nullable=False, metadata={"doc": "when scored"}),
            pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "use case scored"}),
            pa.field("labels_version", pa.string(), nullable=False, metadata={"doc": "golden labels version"}),
            pa.field("candidate", pa.string(), nullable=False, metadata={"doc": "production | challenger"}),
            pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "captioning model version"}),
            pa.field("prompt_version", pa.int32(), nullable=False, metadata={"doc": "caption prompt version"}),
            pa.field(
                "use_case_version", pa.string(), nullable=False, metadata={"doc": "structuring prompt/config version"}
            ),
            pa.field("structurer", pa.string(), nullable=False, metadata={"doc": "structuring model"}),
            pa.field("iou_threshold", pa.float64(), nullable=False, metadata={"doc": "event matching IoU threshold"}),
            pa.field("golden_videos", pa.int32(), nullable=False, metadata={"doc": "labelled videos"}),
            pa.field(
                "scored_videos", pa.int32(), nullable=False, metadata={"doc": "labelled videos with a prediction"}
            ),
            *[pa.field(m, pa.float64(), metadata={"doc": d}) for m, d in HEADLINE_METRICS.items()],
            pa.field("metrics", pa.string(), metadata={"doc": "JSON: every metric, flat name -> value"}),
            pa.field("per_class", pa.string(), metadata={"doc": "JSON: P/R/F1/support per verdict"}),
            pa.field("confusion", pa.string(), metadata={"doc": "JSON: rows expected, columns predicted (+unparsed)"}),
            pa.field("mlflow_run_id", pa.string(), metadata={"doc": "MLflow run holding the same scores"}),
        ]
    ),
    PROMOTIONS: pa.schema(
        [
            pa.field("decision_id", pa.string(), nullable=False, metadata={"doc": "unique id"}),
            pa.field("decided_at", _TS, nullable=False, metadata={"doc": "when decided"}),
            pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "use case the gate scored"}),
            pa.field("production_model_version", pa.string(), nullable=False, metadata={"doc": "before the decision"}),
            pa.field("production_prompt_version", pa.int32(), nullable=False, metadata={"doc": "before the decision"}),
            pa.field("challenger_model_version", pa.string(), nullable=False, metadata={"doc": "candidate model"}),
            pa.field("challenger_prompt_version", pa.int32(), nullable=False, metadata={"doc": "candidate prompt"}),
            pa.field("promoted", pa.bool_(), nullable=False, metadata={"doc": "whether production moved"}),
            pa.field("reason", pa.string(), nullable=False, metadata={"doc": "metric-by-metric comparison"}),
            pa.field("tolerance", pa.float64(), nullable=False, metadata={"doc": "allowed drop per metric"}),
            pa.field("production_eval_id", pa.string(), nullable=False, metadata={"doc": "eval_scores row"}),
            pa.field("challenger_eval_id", pa.string(), nullable=False, metadata={"doc": "eval_scores row"}),
            pa.field("gate", pa.string(), metadata={"doc": "promote | reject | undecided (too few labelled videos)"}),
            pa.field("forced", pa.bool_(), metadata={"doc": "promoted although the gate could not decide (force)"}),
            pa.field("confidence", pa.float64(), metadata={"doc": "confidence of the paired bootstrap intervals"}),
            pa.field("golden_videos", pa.int32(), metadata={"doc": "golden videos scored by both candidates"}),
            pa.field(
                "intervals",
                pa.string(),
                metadata={"doc": "JSON: per gated metric, both values, their difference and its interval"},
            ),
        ]
    ),
}

# Vectors: Delta has no fixed-size array type, so a vector is list<float32> with its length in ``dim``
# (the tables' checks hold every row to it); polars reads it back as ``pl.Array`` with a cast.
_VECTOR = pa.list_(pa.float32())
_WORD = pa.struct(
    [("start_s", pa.float64()), ("end_s", pa.float64()), ("word", pa.string()), ("probability", pa.float64())]
)
_VIDEO = [
    pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
    pa.field("batch_key", pa.string(), nullable=False, metadata={"doc": "upload batch (partition)"}),
    pa.field("uri", pa.string(), nullable=False, metadata={"doc": "the video"}),
]
SCHEMAS[TRANSCRIPTS] = pa.schema(
    _VIDEO
    + [
        pa.field(
            "segment",
            pa.int32(),
            nullable=False,
            metadata={"doc": "speech segment index; -1 on the one row of a video without speech"},
        ),
        pa.field("start_s", pa.float64(), metadata={"doc": "segment start in the video, seconds"}),
        pa.field("end_s", pa.float64(), metadata={"doc": "segment end in the video, seconds"}),
        pa.field("text", pa.string(), metadata={"doc": "what was said; empty unless status is speech"}),
        pa.field("words", pa.list_(_WORD), metadata={"doc": "words with their times and probabilities"}),
        pa.field("language", pa.string(), metadata={"doc": "detected (or configured) language"}),
        pa.field("language_probability", pa.float64(), metadata={"doc": "confidence of the language detection"}),
        pa.field("no_speech_prob", pa.float64(), metadata={"doc": "Whisper's no-speech probability"}),
        pa.field("avg_logprob", pa.float64(), metadata={"doc": "mean token log-probability"}),
        pa.field("status", pa.string(), nullable=False, metadata={"doc": doc(TRANSCRIPT_STATUSES)}),
        pa.field("error", pa.string(), metadata={"doc": "why status is error"}),
        pa.field("model_name", pa.string(), nullable=False, metadata={"doc": "MLflow registered model"}),
        pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "MLflow model version"}),
        pa.field("transcribed_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)
SCHEMAS[FRAME_EMBEDDINGS] = pa.schema(
    _VIDEO
    + [
        pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "caption segment the frame belongs to"}),
        pa.field("frame", pa.int32(), nullable=False, metadata={"doc": "frame index within the segment"}),
        pa.field("timestamp_s", pa.float64(), metadata={"doc": "frame time in the video (the caption's frame)"}),
        pa.field("status", pa.string(), nullable=False, metadata={"doc": doc(EMBEDDING_STATUSES)}),
        pa.field("error", pa.string(), metadata={"doc": "why status is error"}),
        pa.field("encoder", pa.string(), nullable=False, metadata={"doc": "MLflow registered model"}),
        pa.field("encoder_version", pa.string(), nullable=False, metadata={"doc": "MLflow model version"}),
        pa.field("dim", pa.int32(), metadata={"doc": "vector length"}),
        pa.field("embedding", _VECTOR, metadata={"doc": "L2-normalised image vector"}),
        pa.field("ocr_text", pa.string(), metadata={"doc": "on-screen text (null unless frame OCR is on)"}),
        pa.field("embedded_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)
SCHEMAS[TEXT_EMBEDDINGS] = pa.schema(
    _VIDEO
    + [
        pa.field("source", pa.string(), nullable=False, metadata={"doc": doc(EMBEDDING_SOURCES)}),
        pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "the source row's segment"}),
        pa.field(
            "source_version",
            pa.string(),
            nullable=False,
            metadata={"doc": "versions of the source row (transcript: model; caption: model and prompt)"},
        ),
        pa.field("start_s", pa.float64(), metadata={"doc": "time range of the text in the video, start"}),
        pa.field("end_s", pa.float64(), metadata={"doc": "time range of the text in the video, end"}),
        pa.field("text", pa.string(), nullable=False, metadata={"doc": "the text embedded"}),
        pa.field("encoder", pa.string(), nullable=False, metadata={"doc": "MLflow registered model"}),
        pa.field("encoder_version", pa.string(), nullable=False, metadata={"doc": "MLflow model version"}),
        pa.field("dim", pa.int32(), nullable=False, metadata={"doc": "vector length"}),
        pa.field("embedding", _VECTOR, nullable=False, metadata={"doc": "L2-normalised text vector"}),
        pa.field("embedded_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)

SCHEMAS[VIDEO_SUMMARIES] = pa.schema(
    _VIDEO
    + [
        pa.field(
            "summarizer",
            pa.string(),
            nullable=False,
            metadata={"doc": "'extractive', or 'llm:<model>' when an OpenAI-compatible LLM wrote it"},
        ),
        pa.field(
            "summary", pa.string(), nullable=False, metadata={"doc": "what happens in the video, with [mm:ss] times"}
        ),
        pa.field("start_s", pa.float64(), metadata={"doc": "first time covered"}),
        pa.field("end_s", pa.float64(), metadata={"doc": "last time covered"}),
        pa.field("chunks", pa.int32(), metadata={"doc": "map-reduce chunks summarised (1 for a short video)"}),
        pa.field(
            "inputs_version",
            pa.string(),
            nullable=False,
            metadata={"doc": "hash of the caption, transcript and event rows summarised: a change redoes it"},
        ),
        pa.field("summarized_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)

# The frames each caption was made from, as the captions step's decode stage encoded them (JPEG,
# ``core.media.frames``): frame embeddings and curation read these instead of decoding the video again.
SCHEMAS[SAMPLED_FRAMES] = pa.schema(
    _VIDEO
    + [
        pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "caption segment the frame belongs to"}),
        pa.field("frame", pa.int32(), nullable=False, metadata={"doc": "frame index within the segment"}),
        pa.field("timestamp_s", pa.float64(), nullable=False, metadata={"doc": "frame time in the video"}),
        pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "caption model version"}),
        pa.field("prompt_version", pa.int32(), nullable=False, metadata={"doc": "caption prompt version"}),
        pa.field("image", pa.binary(), nullable=False, metadata={"doc": "the frame the model saw, JPEG"}),
        pa.field(
            "screened",
            pa.string(),
            metadata={"doc": "why the planned frame was screened out (dark, flat, blurry, frozen); null: it was not"},
        ),
        pa.field(
            "screened_from_s",
            pa.float64(),
            metadata={"doc": "time of the frame screened out; this row's frame is the nearest useful one after it"},
        ),
        pa.field("sampled_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)
# Each (alert, webhook destination): sent once, or retried until it is (core.delivery.webhooks).
SCHEMAS[ALERT_DELIVERIES] = pa.schema(
    [
        pa.field("alert_id", pa.string(), nullable=False, metadata={"doc": "hash of the alert's key"}),
        pa.field("destination", pa.string(), nullable=False, metadata={"doc": "destination name (its config)"}),
        pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "the alert's video"}),
        pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "the alert's use case"}),
        pa.field("status", pa.string(), nullable=False, metadata={"doc": "sent | retrying"}),
        pa.field("attempts", pa.int32(), nullable=False, metadata={"doc": "requests made"}),
        pa.field("http_status", pa.int32(), metadata={"doc": "the last answer's status; null: no answer"}),
        pa.field("error", pa.string(), metadata={"doc": "why the last attempt failed"}),
        pa.field("first_attempt_at", _TS, nullable=False, metadata={"doc": "first request"}),
        pa.field("last_attempt_at", _TS, nullable=False, metadata={"doc": "last request"}),
        pa.field("next_attempt_at", _TS, nullable=False, metadata={"doc": "when a retry is due"}),
        pa.field("sent_at", _TS, metadata={"doc": "when the destination accepted it (2xx)"}),
    ]
)
# Each segment a camera's recorder wrote into the volume (core.streams.recorder), with the gap before it.
SCHEMAS[STREAM_SEGMENTS] = pa.schema(
    [
        pa.field("uri", pa.string(), nullable=False, metadata={"doc": "the segment's file in the volume"}),
        pa.field("camera", pa.string(), nullable=False, metadata={"doc": "camera name (the config's)"}),
        pa.field("source", pa.string(), nullable=False, metadata={"doc": "the stream URL, without credentials"}),
        pa.field("started_at", _TS, nullable=False, metadata={"doc": "wall-clock start of the segment"}),
        pa.field("ended_at", _TS, nullable=False, metadata={"doc": "wall-clock end (start + its duration)"}),
        pa.field("duration_s", pa.float64(), nullable=False, metadata={"doc": "seconds of video"}),
        pa.field("frames", pa.int32(), nullable=False, metadata={"doc": "video packets (frames) in the file"}),
        pa.field("gap_before_s", pa.float64(), metadata={"doc": "seconds since the camera's previous segment ended"}),
        pa.field(
            "reason",
            pa.string(),
            nullable=False,
            metadata={"doc": "why the segment starts here: first, cut, or why the stream stopped before it"},
        ),
        pa.field("recorded_at", _TS, nullable=False, metadata={"doc": "when the file was renamed into the volume"}),
        pa.field("deleted_at", _TS, metadata={"doc": "when retention deleted the file; null: still there"}),
        pa.field(
            "released_at",
            _TS,
            metadata={"doc": "when a person released it from the evidence hold (retention --release); null: held"},
        ),
    ]
)
# What each camera's recorder is doing now (core.streams.recorder): one row per camera, rewritten as it changes.
SCHEMAS[CAMERA_HEALTH] = pa.schema(
    [
        pa.field("camera", pa.string(), nullable=False, metadata={"doc": "camera name (the config's)"}),
        pa.field("source", pa.string(), nullable=False, metadata={"doc": "the stream URL, without credentials"}),
        pa.field("status", pa.string(), nullable=False, metadata={"doc": "connecting | recording | failing | stopped"}),
        pa.field("since", _TS, nullable=False, metadata={"doc": "when the camera took this status"}),
        pa.field("connects", pa.int32(), nullable=False, metadata={"doc": "connection attempts by this recorder"}),
        pa.field(
            "consecutive_failures",
            pa.int32(),
            nullable=False,
            metadata={"doc": "attempts in a row that recorded nothing; 0 once a segment starts"},
        ),
        pa.field("last_error", pa.string(), metadata={"doc": "why the last connection ended (no credentials)"}),
        pa.field("last_error_at", _TS, metadata={"doc": "when it ended"}),
        pa.field("last_segment", pa.string(), metadata={"doc": "the last segment written (stream_segments.uri)"}),
        pa.field("last_segment_at", _TS, metadata={"doc": "when it was written"}),
        pa.field("updated_at", _TS, nullable=False, metadata={"doc": "when this row was written"}),
    ]
)
# What a challenger changes (core.evaluation.diff): per promotion decision, use case and video, both
# candidates' answers side by side, over the golden videos and a shadow sample of the archive.
SCHEMAS[PROMOTION_DIFFS] = pa.schema(
    [
        pa.field("decision_id", pa.string(), nullable=False, metadata={"doc": "the promotion decision"}),
        pa.field("use_case", pa.string(), nullable=False, metadata={"doc": "use case compared"}),
        pa.field("video_id", pa.string(), nullable=False, metadata={"doc": "sha256 of the bytes"}),
        pa.field("uri", pa.string(), metadata={"doc": "the video"}),
        pa.field("sample", pa.string(), nullable=False, metadata={"doc": "golden | shadow (recent archive videos)"}),
        pa.field("expected", pa.string(), metadata={"doc": "the golden verdict; null in the shadow sample"}),
        pa.field("change", pa.string(), nullable=False, metadata={"doc": "flag_lost, flag_gained, ... same"}),
        pa.field("production_verdict", pa.string(), metadata={"doc": "production's answer for the video"}),
        pa.field("challenger_verdict", pa.string(), metadata={"doc": "the challenger's answer"}),
        pa.field("production_events", pa.list_(_EVENT), metadata={"doc": "production's events"}),
        pa.field("challenger_events", pa.list_(_EVENT), metadata={"doc": "the challenger's events"}),
        pa.field("start_s", pa.float64(), metadata={"doc": "first event of either side; null without events"}),
        pa.field("end_s", pa.float64(), metadata={"doc": "last event of either side"}),
        pa.field("model_version", pa.string(), nullable=False, metadata={"doc": "production's model version"}),
        pa.field("prompt_version", pa.int32(), nullable=False, metadata={"doc": "production's prompt version"}),
        pa.field("use_case_version", pa.string(), nullable=False, metadata={"doc": "use case version"}),
        pa.field("structurer", pa.string(), nullable=False, metadata={"doc": "production's structurer"}),
        pa.field("challenger_model_version", pa.string(), nullable=False, metadata={"doc": "challenger model"}),
        pa.field("challenger_prompt_version", pa.int32(), nullable=False, metadata={"doc": "challenger prompt"}),
        pa.field("diffed_at", _TS, nullable=False, metadata={"doc": "when compared"}),
    ]
)
# A reviewer's decision on a review_queue item (the review page): what the model said and what the person
# said. Keyed by the page's submission id, so a double submit is one row.
SCHEMAS[REVIEW_LABELS] = pa.schema(
    [
        pa.field("label_id", pa.string(), nullable=False, metadata={"doc": "submission id (one per save)"}),
        pa.field("item_id", pa.string(), nullable=False, metadata={"doc": "the review_queue row (its key's hash)"}),
        *_STRUCT_KEY,
        pa.field("uri", pa.string(), metadata={"doc": "the video"}),
        pa.field("model_verdict", pa.string(), metadata={"doc": "what the model said; null if unparsed"}),
        pa.field("model_confidence", pa.float64(), metadata={"doc": "the model's confidence"}),
        pa.field("model_events", pa.list_(_EVENT), metadata={"doc": "the model's events"}),
        pa.field("decision", pa.string(), nullable=False, metadata={"doc": "confirmed | corrected | skipped"}),
        pa.field("verdict", pa.string(), metadata={"doc": "the person's verdict for the video; null if skipped"}),
        pa.field("events", pa.list_(_EVENT), metadata={"doc": "the person's events (seconds in the video)"}),
        pa.field("reviewer", pa.string(), nullable=False, metadata={"doc": "who decided"}),
        pa.field("note", pa.string(), metadata={"doc": "the reviewer's note"}),
        pa.field("labelled_at", _TS, nullable=False, metadata={"doc": "when saved"}),
    ]
)
SCHEMAS[CURATED_FRAMES] = pa.schema(
    _VIDEO
    + [
        pa.field("segment", pa.int32(), nullable=False, metadata={"doc": "caption segment the frame belongs to"}),
        pa.field("frame", pa.int32(), nullable=False, metadata={"doc": "frame index within the segment"}),
        pa.field(
            "curation_version",
            pa.string(),
            nullable=False,
            metadata={"doc": "hash of the curation config (and description prompt and model when describing)"},
        ),
        pa.field("timestamp_s", pa.float64(), nullable=False, metadata={"doc": "frame time (the caption's frame)"}),
        pa.field("kept", pa.bool_(), nullable=False, metadata={"doc": "true when the frame passed every filter"}),
        pa.field("reason", pa.string(), nullable=False, metadata={"doc": doc(CURATION_REASONS)}),
        pa.field("sharpness", pa.float64(), metadata={"doc": "variance of the Laplacian of the luma (in the crop)"}),
        pa.field("brightness", pa.float64(), metadata={"doc": "mean luma 0-255 (in the crop)"}),
        pa.field("contrast", pa.float64(), metadata={"doc": "standard deviation of the luma (in the crop)"}),
        pa.field("motion", pa.float64(), metadata={"doc": "mean abs luma difference to the previous frame, 64x36"}),
        pa.field("crop_x0", pa.int32(), metadata={"doc": "picture without black bars: left column"}),
        pa.field("crop_y0", pa.int32(), metadata={"doc": "top row"}),
        pa.field("crop_x1", pa.int32(), metadata={"doc": "right column (exclusive)"}),
        pa.field("crop_y1", pa.int32(), metadata={"doc": "bottom row (exclusive)"}),
        pa.field("width", pa.int32(), metadata={"doc": "width of the sampled frame before cropping"}),
        pa.field("height", pa.int32(), metadata={"doc": "height of the sampled frame before cropping"}),
        pa.field("phash", pa.string(), metadata={"doc": "64-bit DCT perceptual hash, 16 hex characters"}),
        pa.field("image", pa.binary(), metadata={"doc": "JPEG of the cropped frame (kept frames, image_store blob)"}),
        pa.field("image_uri", pa.string(), metadata={"doc": "JPEG file of the cropped frame (image_store files)"}),
        pa.field("description", pa.string(), metadata={"doc": "VLM description of a kept frame (describe on)"}),
        pa.field("error", pa.string(), metadata={"doc": "why reason is error, or why the description failed"}),
        pa.field("curated_at", _TS, nullable=False, metadata={"doc": "when written"}),
    ]
)

SCHEMAS[CANDIDATE_CAPTIONS] = SCHEMAS[CAPTIONS]
SCHEMAS[CANDIDATE_EVENTS] = SCHEMAS[STRUCTURED_EVENTS]
SCHEMAS[CANDIDATE_SCORES] = SCHEMAS[EVAL_SCORES]

_STRUCT_KEY_NAMES = [f.name for f in _STRUCT_KEY]

# Tables whose rows belong to the upload batch of their video, and every video to one batch (raw_videos
# assigns it): their merges and reads can be pruned to the batch without changing what they match.
BATCH_SCOPED = frozenset(
    {
        VIDEO_METADATA,
        CAPTIONS,
        STRUCTURED_EVENTS,
        CANDIDATE_CAPTIONS,
        CANDIDATE_EVENTS,
        TRANSCRIPTS,
        FRAME_EMBEDDINGS,
        TEXT_EMBEDDINGS,
        VIDEO_SUMMARIES,
        CURATED_FRAMES,
        SAMPLED_FRAMES,
    }
)

KEYS: dict[str, list[str]] = {
    BATCH_MANIFEST: ["uri", "size_bytes", "mtime"],
    RAW_VIDEOS: ["video_id"],
    VIDEO_METADATA: ["video_id"],
    CAPTIONS: ["video_id", "segment", "model_version", "prompt_version"],
    GOLDEN_SET: ["use_case", "video_id"],
    STRUCTURED_EVENTS: _STRUCT_KEY_NAMES,
    ALERTS: _STRUCT_KEY_NAMES,
    REVIEW_QUEUE: _STRUCT_KEY_NAMES,
    EVAL_SCORES: ["eval_id"],
    PROMOTIONS: ["decision_id"],
    CANDIDATE_CAPTIONS: ["video_id", "segment", "model_version", "prompt_version"],
    CANDIDATE_EVENTS: _STRUCT_KEY_NAMES,
    CANDIDATE_SCORES: ["eval_id"],
    TRANSCRIPTS: ["video_id", "segment", "model_version"],
    FRAME_EMBEDDINGS: ["video_id", "segment", "frame", "encoder_version"],
    TEXT_EMBEDDINGS: ["video_id", "source", "segment", "source_version", "encoder_version"],
    VIDEO_SUMMARIES: ["video_id", "summarizer"],
    CURATED_FRAMES: ["video_id", "segment", "frame", "curation_version"],
    SAMPLED_FRAMES: ["video_id", "segment", "frame", "model_version", "prompt_version"],
    REVIEW_LABELS: ["label_id"],
    PROMOTION_DIFFS: ["decision_id", "use_case", "video_id"],
    STREAM_SEGMENTS: ["uri"],
    CAMERA_HEALTH: ["camera"],
    ALERT_DELIVERIES: ["alert_id", "destination"],
}


def required_columns(name: str) -> list[str]:
    return [f.name for f in SCHEMAS[name] if not f.nullable]


def to_arrow(name: str, rows: list[dict]) -> pa.Table:
    """Rows as an arrow table of the declared schema (a wrong type fails here, not in Delta)."""
    return pa.Table.from_pylist(rows, schema=SCHEMAS[name])
