"""The OpenAI-compatible LLM the question-answering agent and the summaries use (vLLM's
``vllm serve <model>`` in production); unset, both work without one (deterministic plans, extractive
answers and summaries)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.qa.llm import LlmClient


class LlmSettings(ConfigurableResource):
    base_url: str | None = Field(
        default=None, description="OpenAI-compatible endpoint, e.g. http://vllm:8000/v1 (LLM_BASE_URL); unset: no LLM"
    )
    model: str = Field(default="", description="Model name the server serves (LLM_MODEL); empty: the first it lists")
    api_key: str = Field(default="EMPTY", description="Bearer key (LLM_API_KEY); never logged")
    timeout_s: float = Field(default=30.0, gt=0, description="Seconds per request")

    def client(self) -> LlmClient | None:
        """A client, or None when no endpoint is configured."""
        if not (self.base_url or "").strip():
            return None
        return LlmClient(self.base_url.strip(), self.model, self.api_key, self.timeout_s)
