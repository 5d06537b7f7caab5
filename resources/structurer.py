"""Which use cases are structured, by which model, and within what bounds."""

from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.inference.vllm import STRUCTURING_VLLM, VllmSettings, vllm_settings

CAPTIONER = "captioner"  # structure with the captioning VLM itself (the version that wrote the caption)


class StructurerSettings(ConfigurableResource):
    use_cases: str = Field(
        default="object_handling", description="Comma-separated use cases (video_assets/usecases/<name>)"
    )
    model: str = Field(
        default=CAPTIONER,
        description=f"'{CAPTIONER}' (the captioning VLM) or a separate text model: a hub id or local folder",
    )
    engine: str = Field(default="auto", description="auto | transformers | vllm")
    device: str = Field(default="auto", description="transformers device: auto | cpu | cuda")
    batch_size: int = Field(default=4, ge=1, description="transformers: captions per generate call")
    max_new_tokens: int = Field(
        default=1024,
        ge=1,
        description="First-pass cap; at or above the longest output the schema admits, so a complete record always fits",
    )
    retry_max_new_tokens: int = Field(default=16, ge=1, description="Cap of the verdict-only retry")
    vllm: dict[str, Any] = Field(
        default={},
        description="vLLM engine settings over the structuring defaults: any field of the `vllm` table "
        "(docs/configuration.md); a misspelt name is an error",
    )

    def vllm_settings(self, model_source: str) -> VllmSettings:
        return vllm_settings(model_source, {**STRUCTURING_VLLM, "max_new_tokens": self.max_new_tokens}, self.vllm)
