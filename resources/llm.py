"""The LLM the question-answering agent and the summaries use: an OpenAI-compatible endpoint (vLLM's
``vllm serve <model>``), or ``captioner``: the caption model itself, on its served application (one
model loaded for captions, structuring, summaries and ask) or its endpoint. Unset, both work without
one (deterministic plans, extractive answers and summaries)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.qa.llm import LlmClient

CAPTIONER = "captioner"  # LLM_BASE_URL's value for "the caption model, where it is served"


class LlmSettings(ConfigurableResource):
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible endpoint, e.g. http://vllm:8000/v1 (LLM_BASE_URL); 'captioner': the "
        "caption model (its Ray Serve application on a Ray that outlives the steps, or its endpoint); unset: no LLM",
    )
    model: str = Field(default="", description="Model name the server serves (LLM_MODEL); empty: the first it lists")
    api_key: str = Field(default="EMPTY", description="Bearer key (LLM_API_KEY); never logged")
    timeout_s: float = Field(default=30.0, gt=0, description="Seconds per request")

    @property
    def uses_captioner(self) -> bool:
        return (self.base_url or "").strip().lower() == CAPTIONER

    def client(self) -> LlmClient | None:
        """A client, or None when no endpoint is configured. 'captioner' is not an endpoint: the caller
        builds its client from the caption model (``defs.engines.caption_model_chat``)."""
        if self.uses_captioner:
            raise ValueError("LLM_BASE_URL=captioner: the caption model's client comes from its served application")
        if not (self.base_url or "").strip():
            return None
        return LlmClient(self.base_url.strip(), self.model, self.api_key, self.timeout_s)
