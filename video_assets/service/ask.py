"""``POST /api/ask``: a question about the archive answered by the agent (``core.qa.agent``) over the
app's searcher, with the app's LLM client (``app.state.llm``; None: deterministic plan, extractive answer)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from video_assets.core.qa.agent import ask
from video_assets.core.search.api import public

router = APIRouter()


class AskRequest(BaseModel):
    question: str = Field(min_length=1, max_length=2000)
    k: int = Field(default=8, ge=1, le=50)

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the question is empty")
        return value.strip()


@router.post("/api/ask")
def ask_question(body: AskRequest, request: Request) -> dict:
    """The answer: text citing evidence as [n], the cited hits, the plan run, mode and notes."""
    state = request.app.state
    return public(ask(body.question, state.searcher, getattr(state, "llm", None), k=body.k).to_dict())
