"""Where a structured row goes: alerts, the human review queue, or nowhere. Pure."""

from __future__ import annotations

from video_assets.core.vocabulary import ALERTS, FLAGGED, NO_CAPTION, REVIEW_QUEUE, UNPARSED

EXCERPT_CHARS = 300


def route(row: dict, threshold: float) -> tuple[str | None, str]:
    """(ALERTS | REVIEW_QUEUE | None, reason) for one structured_events row.

    A flagged verdict (confirmed/suspected) with confidence >= threshold -> alerts; below it, any other
    answered verdict but none, or no confidence (only the retry answered) -> review; unparsed -> review
    (a person must look: the model could not answer); none and no_caption -> nowhere (a no_caption row
    is already an error in captions). A flagged row whose every event was dropped for falling outside its
    clip (``events_outside``) -> review: the evidence the verdict stood on is gone.
    """
    status, verdict, conf = row.get("status"), row.get("verdict"), row.get("confidence")
    if status == UNPARSED:
        return REVIEW_QUEUE, "unparsed: the model's output did not fit the schema"
    if status == NO_CAPTION or verdict is None or verdict == "none":
        return None, "nothing to route"
    if verdict not in FLAGGED:
        return REVIEW_QUEUE, f"verdict {verdict}"
    if row.get("events_outside") and not row.get("events"):
        return REVIEW_QUEUE, f"{verdict} with every event outside the clip: {row.get('error') or 'dropped'}"
    if conf is None:
        return REVIEW_QUEUE, f"{verdict} without a confidence (verdict-only retry)"
    if conf >= threshold:
        return ALERTS, f"{verdict} with confidence {conf:.2f} >= {threshold:.2f}"
    return REVIEW_QUEUE, f"{verdict} with confidence {conf:.2f} < {threshold:.2f}"


def evidence(row: dict, prose: str | None) -> dict:
    """The time range and text a person needs to check the row."""
    events = row.get("events") or []
    if events:
        start, end = min(e["start_s"] for e in events), max(e["end_s"] for e in events)
    else:
        start, end = row.get("segment_start_s"), row.get("segment_end_s")
    text = (prose or "").strip()
    return {
        "start_s": start,
        "end_s": end,
        "excerpt": text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…",
    }


def wall_clock(row: dict, segment: dict | None, now) -> dict:
    """A camera segment's routed row in the camera's own time: ``camera``, ``wall_start`` / ``wall_end`` (the
    segment's wall-clock start + the evidence's offsets; a row without event times is about the whole
    segment) and ``detected_after_s`` (from ``wall_start`` to ``now``, when the row is written); all None for
    a video that is not a camera's segment."""
    from datetime import timedelta

    if segment is None:
        return {"camera": None, "wall_start": None, "wall_end": None, "detected_after_s": None}
    began = segment["started_at"]
    if row.get("start_s") is None:
        start, end = began, segment.get("ended_at")
    else:
        start = began + timedelta(seconds=float(row["start_s"]))
        end = began + timedelta(seconds=float(row["end_s"] if row.get("end_s") is not None else row["start_s"]))
    return {
        "camera": segment["camera"],
        "wall_start": start,
        "wall_end": end,
        "detected_after_s": round((now - start).total_seconds(), 3),
    }


def split(rows: list[dict], threshold: float, prose: dict) -> tuple[list[dict], list[dict]]:
    """(alerts, review_queue) rows with reason and evidence; ``prose`` maps (video_id, segment) to text."""
    alerts, review = [], []
    for r in rows:
        where, reason = route(r, threshold)
        if where is None:
            continue
        out = {**r, "reason": reason, "threshold": threshold, **evidence(r, prose.get((r["video_id"], r["segment"])))}
        (alerts if where == ALERTS else review).append(out)
    return alerts, review
