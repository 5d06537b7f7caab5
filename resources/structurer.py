"""Which use cases are structured, by which model, and within what bounds."""

from typing import Any

from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field

from video_assets.core.inference.vllm import STRUCTURING_VLLM, VllmSettings, vllm_settings
from video_assets.core.structuring import usecase as uc_mod

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

    def setup_for_execution(self, context: InitResourceContext) -> None:
        # Before the step does any work (captions holds this resource too): a misspelt use case fails
        # the run's first expensive step in seconds, naming the setting, not after the captions job.
        self.use_case_list()

    def use_case_list(self) -> list[uc_mod.UseCase]:
        """The configured use cases; a ValueError naming the setting when one is unknown or invalid."""
        try:
            return uc_mod.parse_names(self.use_cases)
        except ValueError as exc:
            raise ValueError(f"VIDEO_USE_CASES (structurer.use_cases) = {self.use_cases!r}: {exc}") from exc

    def vllm_settings(self, model_source: str) -> VllmSettings:
        return vllm_settings(model_source, {**STRUCTURING_VLLM, "max_new_tokens": self.max_new_tokens}, self.vllm)
