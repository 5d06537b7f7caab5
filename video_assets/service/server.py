"""Build the searcher from model folders and an index, and serve the app with uvicorn."""

from __future__ import annotations

from pathlib import Path

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8300


class IndexMissing(FileNotFoundError):
    """No search index yet: the message says what to run."""


def build_searcher(
    index_uri: str,
    text_model: str | Path,
    frame_model: str | Path | None = None,
    text_version: str | None = None,
    frame_version: str | None = None,
):
    """A ``LanceSearcher`` on ``index_uri`` with the text encoder in ``text_model`` (and the frame
    encoder in ``frame_model``, for image uploads); ``IndexMissing`` when the index is not there."""
    from video_assets.core.search.index import LanceSearcher, index_exists

    if not index_exists(index_uri):
        raise IndexMissing(
            f"no search index at {index_uri}: run `make demo` first (it materialises search_index), "
            "or point VIDEO_INDEX_URI at an existing index"
        )
    from video_assets.core.embeddings.text import TextEncoder

    frames = None
    if frame_model is not None:
        from video_assets.core.embeddings.job import load_frame_encoder

        frames = load_frame_encoder(frame_model)
    return LanceSearcher(index_uri, TextEncoder(text_model), frames, text_version, frame_version)


def serve(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
