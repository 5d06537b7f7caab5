"""What a search returns, and the operations the service and the question-answering agent call: the one
contract between the index (``core.search``), the HTTP service (``video_assets.service``) and the agent
(``core.qa``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

# Where a hit's text comes from (text_embeddings.source, plus frames, events and summaries).
TRANSCRIPT, CAPTION, FRAME, EVENT, SUMMARY = "transcript", "caption", "frame", "event", "summary"


@dataclass(frozen=True)
class Hit:
    video_id: str
    uri: str
    source: str  # TRANSCRIPT | CAPTION | FRAME | EVENT | SUMMARY
    start_s: float
    end_s: float
    score: float  # higher is better; comparable within one result list only
    text: str  # the matching text (a frame: its OCR text or "")
    segment: int | None = None
    extra: dict = field(default_factory=dict)  # source-specific: verdict, confidence, use_case, words, ...

    @property
    def thumbnail_url(self) -> str:
        """The service's thumbnail of the hit's first instant."""
        return f"/api/videos/{self.video_id}/thumbnail?t={self.start_s:.3f}"

    @property
    def citation(self) -> str:
        """How an answer cites the hit: the file and its time range."""
        name = self.uri.rsplit("/", 1)[-1]
        return f"{name} {_clock(self.start_s)}-{_clock(self.end_s)}"

    def to_dict(self) -> dict:
        return {**asdict(self), "thumbnail_url": self.thumbnail_url, "citation": self.citation}


def _clock(seconds: float) -> str:
    seconds = max(0.0, float(seconds))
    return f"{int(seconds // 60):02d}:{seconds % 60:04.1f}"


class Searcher(Protocol):
    """The searches over the index (implemented in ``core.search``)."""

    def search_text(
        self, query: str, k: int = 10, offset: int = 0, sources: tuple[str, ...] = (TRANSCRIPT, CAPTION)
    ) -> list[Hit]:
        """Hybrid lexical + semantic search over transcript segments and captions (fused ranks)."""
        ...

    def search_window(self, video_id: str, start_s: float, end_s: float) -> list[Hit]:
        """Every transcript segment and caption of ``video_id`` overlapping [start_s, end_s], in time order."""
        ...

    def similar_frames(self, video_id: str, t: float, k: int = 10) -> list[Hit]:
        """Frames nearest to the frame of ``video_id`` at (or nearest to) ``t``."""
        ...

    def events(
        self,
        use_case: str | None = None,
        verdict: str | None = None,
        min_confidence: float | None = None,
        after_s: float | None = None,
        before_s: float | None = None,
        k: int = 50,
    ) -> list[Hit]:
        """Structured events matching every given filter; ``after_s``/``before_s``: the event starts at or
        after ``after_s`` and ends at or before ``before_s``."""
        ...

    def video(self, video_id: str) -> list[Hit]:
        """Everything indexed for one video (segments, captions, events, its summary), in time order."""
        ...


def public(obj):
    """A response with every ``uri`` reduced to the file's name: no server path leaves the service."""
    if isinstance(obj, dict):
        return {k: (v.rsplit("/", 1)[-1] if k == "uri" and isinstance(v, str) else public(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj
