"""Which use cases are structured, by which model, and within what bounds."""

from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.inference.vllm import VllmSettings, with_overrides

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
    vllm_batch_size: int = Field(default=64, ge=1, description="vLLM: rows per Ray Data batch sent to an engine")
    max_new_tokens: int = Field(
        default=1024,
        ge=1,
        description="First-pass cap; at or above the longest output the schema admits, so a complete record always fits",
    )
    retry_max_new_tokens: int = Field(default=16, ge=1, description="Cap of the verdict-only retry")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM")
    max_model_len: int = Field(default=8192, ge=256, description="vLLM")
    vllm_cpu_stage_max_actors: int = Field(
        default=4, ge=1, description="vLLM: each of Ray's CPU stages (chat template, tokenize) scales up to this"
    )

    vllm_overrides: dict[str, Any] = Field(
        default={},
        description="vLLM: any other engine setting (video_assets.core.inference.vllm.VllmSettings), e.g. "
        'placement_group_config={"bundles": [{"CPU": 1}]} for vLLM\'s CPU build; wins over the fields above',
    )

    def vllm_settings(self, model_source: str) -> VllmSettings:
        settings = dict(
            model_source=model_source,
            tensor_parallel_size=self.tensor_parallel_size,
            batch_size=self.vllm_batch_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            max_new_tokens=self.max_new_tokens,
            cpu_stage_max_actors=self.vllm_cpu_stage_max_actors,
        )
        return with_overrides(settings, self.vllm_overrides)
