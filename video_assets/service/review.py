"""The review page and its API: the review queue of a use case, ranked (``core.review.queue``), and a
reviewer's decisions saved as ``review_labels`` rows (``core.review.labels``).

Reads are open like the rest of the service (it binds 127.0.0.1 by default). A write needs:
- the instance's reviewer token in ``X-Review-Token`` (``video-assets review-token`` prints it; created
  once, mode 0600, never logged): 401 without it, 503 when the service has none;
- a same-origin request: a browser's ``Sec-Fetch-Site`` other than same-origin, or an ``Origin`` that is not
  this service, is refused (403); the body must be JSON (415), so a plain cross-site form cannot post;
- a body valid under the use case's own schema (422 with the reason), naming an item in the queue (404),
  with event times inside the clip (its duration from video_metadata, else probed from the file; 422 naming
  the field, or when the duration cannot be known).
A save is one Delta commit before the answer (nothing is lost once the page says saved); the row is keyed
by the page's submission id, so a double submit leaves one label.
"""

from __future__ import annotations

import hmac
import logging
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, PlainTextResponse
from pydantic import ValidationError

from video_assets.core.review.labels import (
    export_jsonl,
    golden_with_reviews,
    label_input,
    label_row,
    outside_clip,
)
from video_assets.core.review.queue import ranked
from video_assets.core.structuring import usecase
from video_assets.core.tables import (
    CANDIDATE_EVENTS,
    PROMOTION_DIFFS,
    REVIEW_LABELS,
    REVIEW_QUEUE,
    SCHEMAS,
    VIDEO_METADATA,
    to_arrow,
)
from video_assets.core.uploads.discovery import printable
from video_assets.core.validation import reasons

TOKEN_HEADER = "X-Review-Token"
PAGE = Path(__file__).resolve().parent / "static" / "review.html"
log = logging.getLogger("video_assets.review")
router = APIRouter()


def _tables(request: Request):
    tables = getattr(request.app.state, "tables", None)
    if tables is None:
        raise HTTPException(503, "no tables configured: start the service with its Delta tables (--tables)")
    return tables


def _use_case(name: str) -> usecase.UseCase:
    if name not in usecase.available():
        raise HTTPException(404, f"unknown use case {printable(name)!r}: have {', '.join(usecase.available())}")
    return usecase.load(name)


def _sources(tables) -> dict:
    """What ``ranked`` reads, read once for every use case of a request."""
    names = {"queue": REVIEW_QUEUE, "labels": REVIEW_LABELS, "challenger": CANDIDATE_EVENTS, "diffs": PROMOTION_DIFFS}
    return {arg: tables.read(name, SCHEMAS[name]) for arg, name in names.items()}


def _items(sources: dict, use_case: str) -> list[dict]:
    return ranked(use_case=use_case, **sources)


def _json_safe(item: dict) -> dict:
    return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in item.items()}


def _may_write(request: Request) -> None:
    """401/403/415/503 unless the request carries the reviewer token, comes from this service's own page and
    is JSON; the token is compared in constant time and never echoed or logged."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise HTTPException(403, f"cross-site request refused (Sec-Fetch-Site: {printable(site)})")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        raise HTTPException(403, "cross-site request refused (Origin is not this service)")
    expected = getattr(request.app.state, "review_token", None)
    if not expected:
        raise HTTPException(503, "no reviewer token configured: writes are off (video-assets serve creates one)")
    given = request.headers.get(TOKEN_HEADER, "")
    if not given or not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(401, f"the reviewer token is missing or wrong ({TOKEN_HEADER}; video-assets review-token)")
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(415, "the body must be application/json")


def _duration(request: Request, tables, item: dict) -> float | None:
    """Seconds of the item's video: probed by the pipeline (video_metadata), else probed here from the
    registered file; None when neither can say."""
    meta = tables.read(VIDEO_METADATA, SCHEMAS[VIDEO_METADATA], where=pl.col("video_id") == item["video_id"])
    known = [d for d in meta.get_column("duration_s").to_list() if d is not None] if not meta.is_empty() else []
    if known:
        return float(known[0])
    uri = item.get("uri")
    if not uri:
        return None
    from video_assets.core.media.probe import probe

    volume = getattr(request.app.state, "volume", None)
    try:
        with volume.open(uri) if volume is not None else open(uri.removeprefix("file://"), "rb") as stream:
            return probe(stream).duration_s
    except (OSError, ValueError):
        return None


@router.get("/review", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(PAGE, media_type="text/html")


@router.get("/api/review/use_cases", summary="Use cases: verdicts, limits and items waiting for review")
def use_cases(request: Request) -> dict:
    out = []
    tables = getattr(request.app.state, "tables", None)
    sources = _sources(tables) if tables is not None else None
    for name in usecase.available():
        uc = usecase.load(name)
        limits = {"max_events": uc.max_events, "max_text": uc.max_text, "max_seconds": uc.max_seconds}
        waiting = len(_items(sources, name)) if sources is not None else 0
        out.append(
            {"name": name, "title": uc.title, "question": uc.question, "verdicts": uc.verdicts, **limits}
            | {"waiting": waiting}
        )
    return {"use_cases": out}


@router.get("/api/review/queue", summary="The use case's review queue, in review order")
def queue(request: Request, use_case: str, k: int = Query(50, ge=1, le=1000)) -> dict:
    _use_case(use_case)
    items = _items(_sources(_tables(request)), use_case)
    return {"use_case": use_case, "count": len(items), "items": [_json_safe(i) for i in items[:k]]}


@router.post("/api/review/labels", summary="Save a reviewer's decision on a queue item (reviewer token)")
async def save_label(request: Request, use_case: str) -> dict:
    _may_write(request)
    uc = _use_case(use_case)
    try:
        label = label_input(uc).model_validate_json(await request.body())
    except ValidationError as exc:
        raise HTTPException(422, printable(reasons(exc, whole="body"))) from None
    tables = _tables(request)
    done = tables.read(REVIEW_LABELS, SCHEMAS[REVIEW_LABELS])
    if not done.is_empty() and label.label_id in set(done.get_column("label_id").to_list()):
        return {"saved": False, "label_id": label.label_id, "detail": "already saved (a repeated submit)"}
    queue_df = tables.read(REVIEW_QUEUE, SCHEMAS[REVIEW_QUEUE])
    diffs = tables.read(PROMOTION_DIFFS, SCHEMAS[PROMOTION_DIFFS])
    every = ranked(queue_df, use_case, diffs=diffs)  # the item, whether or not it was decided before
    item = next((i for i in every if i["item_id"] == label.item_id), None)
    if item is None:
        raise HTTPException(404, f"no review item {label.item_id} in use case {use_case}")
    if label.events:  # a label replaces the shipped one: its times must be times of this clip
        duration = _duration(request, tables, item)
        if duration is None:
            raise HTTPException(422, "body: the clip's duration is unknown, so its event times cannot be checked")
        if why := outside_clip(label.events, duration):
            raise HTTPException(422, f"body: {why}")
    row = label_row(item, label, datetime.now(UTC))
    # One commit, keyed by the submission id: a repeated submit that raced past the check above still
    # leaves one row (the first; update=False).
    tables.merge(REVIEW_LABELS, to_arrow(REVIEW_LABELS, [row]), ["label_id"], update=False)
    if (on_write := getattr(request.app.state, "on_write", None)) is not None:  # the instance sees the new label
        try:
            on_write(REVIEW_LABELS, {"label_id": row["label_id"], "use_case": use_case, "decision": row["decision"]})
        except Exception as exc:  # the label is saved; only its report to the instance failed: said, not lost
            log.warning(f"label {row['label_id']} saved, but not reported to the Dagster instance: {exc!r}"[:500])
    return {"saved": True, "label_id": label.label_id, "decision": row["decision"]}


@router.get("/api/review/labels", summary="Saved labels of a use case, newest first")
def labels(request: Request, use_case: str, k: int = Query(100, ge=1, le=10000)) -> dict:
    _use_case(use_case)
    df = _tables(request).read(REVIEW_LABELS, SCHEMAS[REVIEW_LABELS])
    if not df.is_empty():
        df = df.filter(df["use_case"] == use_case).sort("labelled_at", descending=True)
    rows = [_json_safe(r) for r in df.head(k).to_dicts()]
    return {"use_case": use_case, "count": df.height, "labels": rows}


@router.get("/api/review/export", summary="The use case's labels as golden.jsonl (shipped + reviewed)")
def export(request: Request, use_case: str, reviewed_only: bool = False) -> PlainTextResponse:
    from video_assets.core.evaluation.golden import golden_rows, load_labels

    uc = _use_case(use_case)
    records, version = load_labels(uc.golden_path) if uc.golden_path.exists() else ([], "none")
    reviewed = _tables(request).read(REVIEW_LABELS, SCHEMAS[REVIEW_LABELS]).to_dicts()
    rows = golden_with_reviews(use_case, golden_rows(use_case, records, version), version, reviewed)
    if reviewed_only:
        rows = [r for r in rows if r["source"] == "reviewed"]
    return PlainTextResponse(
        export_jsonl(rows),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": f'attachment; filename="{use_case}-golden.jsonl"'},
    )
