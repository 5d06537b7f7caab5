"""The segment row both captioning engines hand on (the Ray Data job's and vLLM's): which columns pass
through from the CPU stage, and how its error column reads. Its own module so that the job and the vLLM
engine share it without importing each other."""

from __future__ import annotations

# Columns of a segment row that the VLM stage hands on as they came from the CPU stage.
CARRIED_COLUMNS = (
    "video_id",
    "batch_key",
    "uri",
    "segment",
    "segments",
    "segment_start_s",
    "segment_end_s",
    "decode_s",
    "decode_node",
    "preview",
)


def decode_error(value) -> str | None:
    """The CPU stage's error of a row, whatever Ray's batch format made of the column."""
    return value if isinstance(value, str) and value else None
