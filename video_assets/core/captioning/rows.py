"""The segment row both captioning engines hand on (the Ray Data job's and vLLM's): which columns pass
through from the CPU stage, and how its error column reads. Its own module so that the job and the vLLM
engine share it without importing each other."""

from __future__ import annotations

from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

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
    "frames",  # the segment's JPEGs: the captions step keeps them (sampled_frames) for the later stages
    "screened",  # JSON list of the frames screened before the engine (media.screening); "" for none
)


def decode_error(value) -> str | None:
    """The CPU stage's error of a row, whatever Ray's batch format made of the column."""
    return value if isinstance(value, str) and value else None


def result_row(
    row: dict, text: str, input_tokens: int, output_tokens: int, latency_s: float, error: str | None
) -> dict:
    """A segment row of the job's results (``job.RESULT_COLUMNS`` but ``engine_node``) from a request stage's
    answer: the carried columns as they came, the answer, and the CPU stage's error first."""
    error = decode_error(row.get("decode_error")) or error
    out = {k: row.get(k) for k in CARRIED_COLUMNS}
    times = row.get("frame_timestamps")  # a list, or an array after a numpy batch
    out.update(
        frame_timestamps=[float(t) for t in (times if times is not None else [])],
        engine_s=latency_s,
        prose=text,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        latency_s=latency_s,
        status=CAPTION_ERROR if error else CAPTION_OK,
        error=error,
    )
    return out
