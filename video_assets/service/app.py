"""The HTTP service over the search index: JSON endpoints, thumbnails, the videos themselves (with HTTP
Range, so a ``<video>`` element seeks) and the web page.

FastAPI under uvicorn rather than Ray Serve: a laptop user runs one small process, bound to 127.0.0.1,
with no cluster to start; the searcher is plain Python in that process (LanceDB embedded, MiniLM on the
CPU); OpenAPI (``/openapi.json``) and its docs (``/docs``) come built in. Ray Serve pays off when the
models need replicas on GPUs across nodes, which a query encoder of this size does not.

This module imports no Dagster: ``tables`` is anything with ``read(name)`` returning a polars frame
(``resources.delta.DeltaTables``), ``volume`` anything with ``open(uri)`` returning a seekable binary
stream (``resources.volume.VideoVolume``); without a volume a registered uri is opened as a local path.
Videos are only ever looked up by id in ``raw_videos``: no path comes from a request.
"""

from __future__ import annotations

import io
import mimetypes
import re
from email.parser import BytesParser
from email.policy import HTTP
from functools import lru_cache
from pathlib import Path

import numpy as np
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from video_assets.core.search.api import Hit, public
from video_assets.core.search.index import DEPTH, MAX_K, SOURCES
from video_assets.core.uploads.discovery import printable

STATIC = Path(__file__).resolve().parent / "static"
THUMB_WIDTH = 320
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
# An uploaded image's pixels, read from its header before decoding: a 136 KB PNG can claim 12000x12000
# (432 MB as RGB). 40 MP holds any camera's frame; the encoder shrinks it to a few hundred pixels anyway.
MAX_IMAGE_PIXELS = 40_000_000
CHUNK = 256 * 1024
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
MAX_SECONDS = 10_000_000.0  # about 116 days: any time in a video; larger (1e308, inf) is refused with 422
MAX_WEIGHT = 100.0


def seconds(default, description: str = "seconds into the video"):
    """A query parameter holding a time: finite and within [0, MAX_SECONDS], else 422 (never a 500)."""
    return Query(default, ge=0, le=MAX_SECONDS, allow_inf_nan=False, description=description)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 while it is read (by its
    stated length, else as it streams in), whichever endpoint reads it; never held whole in memory."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stated = dict(scope.get("headers") or []).get(b"content-length", b"")
        if stated.isdigit() and int(stated) > self.limit:
            return await JSONResponse({"detail": f"body over {self.limit} bytes"}, status_code=413)(
                scope, receive, send
            )
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > self.limit:  # raised inside the endpoint's read: its exception handler answers 413
                raise HTTPException(413, f"body over {self.limit} bytes")
            return message

        return await self.app(scope, limited, send)


def _hits(hits: list[Hit]) -> dict:
    return {"count": len(hits), "hits": public([h.to_dict() for h in hits])}


class Videos:
    """video_id -> registered uri, from ``raw_videos`` (re-read when an id is not known yet)."""

    def __init__(self, tables):
        self.tables = tables
        self._uris: dict[str, str] = {}

    def _load(self) -> None:
        if self.tables is None:
            return
        df = self.tables.read("raw_videos")
        if not df.is_empty():
            self._uris = dict(zip(df.get_column("video_id").to_list(), df.get_column("uri").to_list(), strict=True))

    def uri(self, video_id: str) -> str | None:
        if video_id not in self._uris:
            self._load()
        return self._uris.get(video_id)


def create_app(searcher, *, tables=None, volume=None, **state) -> FastAPI:
    """The app: ``app.state.searcher`` is ``searcher``, every extra keyword is stored on ``app.state``
    (the ask router reads ``app.state.llm``, the review router ``app.state.review_token``: without one,
    review writes are refused)."""
    app = FastAPI(
        title="video-assets search",
        description="Hybrid search over the video archive's transcripts, captions, frames and events.",
        version="1",
    )
    app.add_middleware(BodyLimit, limit=MAX_UPLOAD_BYTES)
    app.state.searcher = searcher
    app.state.tables = tables
    app.state.volume = volume
    for key, value in state.items():
        setattr(app.state, key, value)
    videos = Videos(tables)
    api = APIRouter(prefix="/api")

    def registered(video_id: str) -> str:
        uri = videos.uri(video_id)
        if uri is None:
            raise HTTPException(404, f"unknown video_id {video_id!r}")
        return uri

    def known(video_id: str) -> None:
        has_video = getattr(searcher, "has_video", lambda _: False)
        if videos.uri(video_id) is None and not has_video(video_id):
            raise HTTPException(404, f"unknown video_id {video_id!r}")

    def open_video(video_id: str, uri: str):
        """The registered file, or 410 (gone from the volume) / 404 (refused: a link, not a regular file)."""
        try:
            if volume is not None:
                return volume.open(uri)
            return open(uri.removeprefix("file://"), "rb")
        except FileNotFoundError as exc:
            raise HTTPException(410, f"the file of video {video_id} is no longer in the volume") from exc
        except (OSError, ValueError) as exc:
            raise HTTPException(404, f"the file of video {video_id} cannot be read ({type(exc).__name__})") from exc

    @api.get("/search", summary="Hybrid lexical + semantic search (weighted reciprocal rank fusion)")
    def search(
        q: str = Query(..., description="the query"),
        k: int = Query(10, ge=1, le=MAX_K, description="hits per page"),
        offset: int = Query(0, ge=0, description=f"hits to skip (offset + k <= {DEPTH})"),
        sources: str = Query("transcript,caption", description=f"comma-separated, of {', '.join(SOURCES)}"),
        w_lexical: float | None = Query(
            None, ge=0, le=MAX_WEIGHT, allow_inf_nan=False, description="weight of the BM25 ranking (default 1)"
        ),
        w_semantic: float | None = Query(
            None, ge=0, le=MAX_WEIGHT, allow_inf_nan=False, description="weight of the vector ranking (default 1)"
        ),
        video_id: str | None = Query(None, description="only this video"),
    ) -> dict:
        if not q.strip():
            raise HTTPException(422, "q is empty")
        if offset + k > DEPTH:
            raise HTTPException(422, f"offset + k must be <= {DEPTH}")
        wanted = tuple(s.strip() for s in sources.split(",") if s.strip())
        unknown = [s for s in wanted if s not in SOURCES]
        if unknown or not wanted:
            raise HTTPException(422, f"unknown source(s) {unknown}: choose from {list(SOURCES)}")
        if video_id is not None:
            known(video_id)
        try:
            hits = searcher.search_text(
                q, k=k, offset=offset, sources=wanted, video_id=video_id, w_lexical=w_lexical, w_semantic=w_semantic
            )
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from exc
        return {"query": q, "k": k, "offset": offset, **_hits(hits)}

    @api.get("/window", summary="Transcript segments and captions overlapping a time window")
    def window(video_id: str, start_s: float = seconds(...), end_s: float = seconds(...)) -> dict:
        if end_s < start_s:
            raise HTTPException(422, "end_s is before start_s")
        known(video_id)
        try:
            return _hits(searcher.search_window(video_id, start_s, end_s))
        except ValueError as exc:  # a value the index's filter refuses
            raise HTTPException(422, printable(exc)) from exc

    @api.get("/frames/similar", summary="Frames nearest to a stored frame (the one nearest t)")
    def similar(video_id: str, t: float = seconds(0.0), k: int = Query(10, ge=1, le=MAX_K)) -> dict:
        known(video_id)
        return _hits(searcher.similar_frames(video_id, t, k))

    @api.post("/frames/similar", summary="Frames nearest to an uploaded image (multipart field 'image', or raw)")
    async def similar_image(request: Request, k: int = Query(10, ge=1, le=MAX_K)) -> dict:
        body = await request.body()  # at most MAX_UPLOAD_BYTES: BodyLimit refuses more while it streams in
        image = _decoded_image(_uploaded_image(request.headers.get("content-type", ""), body))
        if getattr(searcher, "frame_encoder", None) is None:
            raise HTTPException(503, "no frame encoder loaded: image search is off")
        return _hits(searcher.similar_to_image(image, k))

    @api.get("/events", summary="Structured events matching every filter")
    def events(
        use_case: str | None = None,
        verdict: str | None = None,
        min_confidence: float | None = Query(None, ge=0, le=1, allow_inf_nan=False),
        after_s: float | None = seconds(None),
        before_s: float | None = seconds(None),
        video_id: str | None = None,
        k: int = Query(50, ge=1, le=1000),
    ) -> dict:
        if after_s is not None and before_s is not None and before_s < after_s:
            raise HTTPException(422, "before_s is before after_s")
        try:
            found = searcher.events(use_case, verdict, min_confidence, after_s, before_s, k, video_id=video_id)
        except ValueError as exc:  # a name the index's filter refuses (see core.search.index)
            raise HTTPException(422, printable(exc)) from exc
        return _hits(found)

    @api.get("/videos/{video_id}", summary="Everything indexed for one video, in time order")
    def video(video_id: str) -> dict:
        known(video_id)
        return {"video_id": video_id, **public({"uri": videos.uri(video_id) or ""}), **_hits(searcher.video(video_id))}

    @lru_cache(maxsize=256)
    def thumbnail_bytes(video_id: str, t_ms: int) -> bytes:
        from video_assets.core.media.thumbnails import frame_jpeg

        with open_video(video_id, registered(video_id)) as stream:
            return frame_jpeg(stream, t_ms / 1000.0, THUMB_WIDTH)

    @api.get("/videos/{video_id}/thumbnail", summary="JPEG of the frame at t (seconds)")
    def thumbnail(video_id: str, t: float = seconds(0.0)) -> Response:
        registered(video_id)
        try:
            data = thumbnail_bytes(video_id, int(round(t * 1000 / 100)) * 100)  # cached per 0.1 s
        except (OSError, ValueError) as exc:  # the reason's class only: its text may hold a server path
            raise HTTPException(422, f"no frame at t={t}: {type(exc).__name__}") from exc
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    @api.get("/videos/{video_id}/file", summary="The video's bytes (HTTP Range honoured)")
    def file(video_id: str, request: Request) -> Response:
        uri = registered(video_id)
        stream = open_video(video_id, uri)
        size = stream.seek(0, io.SEEK_END)
        media = mimetypes.guess_type(uri)[0] or "application/octet-stream"
        headers = {"Accept-Ranges": "bytes"}
        rng = request.headers.get("range")
        start, end, status = 0, size - 1, 200
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                stream.close()
                return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:  # the last N bytes
                start, end = max(0, size - int(m.group(2))), size - 1
            if start >= size or end < start:
                stream.close()
                return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(end - start + 1)

        def body():
            try:
                stream.seek(start)
                left = end - start + 1
                while left > 0:
                    chunk = stream.read(min(CHUNK, left))
                    if not chunk:
                        break
                    left -= len(chunk)
                    yield chunk
            finally:
                stream.close()

        return StreamingResponse(body(), status_code=status, media_type=media, headers=headers)

    app.include_router(api)
    from video_assets.service.ask import router as ask_router  # imports the agent: only with the app

    app.include_router(ask_router)
    from video_assets.service.review import router as review_router

    app.include_router(review_router)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.exception_handler(HTTPException)
    async def _reason(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Where and why, escaped; never the input echoed back (a lone surrogate cannot even be encoded).
        detail = [
            {"loc": [printable(p) for p in e.get("loc", ())], "msg": printable(e.get("msg", "")), "type": e.get("type")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    return app


def _decoded_image(data: bytes) -> np.ndarray:
    """The upload as an RGB array: 422 when it is not an image, or when its header claims more than
    ``MAX_IMAGE_PIXELS`` (checked before a pixel is decoded)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        width, height = img.size
    except Exception as exc:
        raise HTTPException(422, f"not a readable image: {exc.__class__.__name__}") from exc
    if width * height > MAX_IMAGE_PIXELS:
        raise HTTPException(
            422, f"image of {width}x{height} pixels is over {MAX_IMAGE_PIXELS // 1_000_000} megapixels: send it smaller"
        )
    try:
        return np.asarray(img.convert("RGB"))
    except Exception as exc:
        raise HTTPException(422, f"not a readable image: {exc.__class__.__name__}") from exc


def _uploaded_image(content_type: str, body: bytes) -> bytes:
    """The image bytes of a multipart/form-data upload (field ``image``, or the first file), or the raw
    body for any other content type (parsed with the standard library: no extra dependency)."""
    if not content_type.lower().startswith("multipart/"):
        if not body:
            raise HTTPException(422, "no image in the request body")
        return body
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    parts = [p for p in message.iter_parts() if p.get_content_disposition() == "form-data"]
    named = [p for p in parts if p.get_param("name", header="content-disposition") == "image"]
    for part in named or [p for p in parts if p.get_filename()]:
        data = part.get_payload(decode=True)
        if data:
            return data
    raise HTTPException(422, "no 'image' file in the multipart upload")
