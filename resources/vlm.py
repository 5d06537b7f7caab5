"""Which captioning model, which engine, and how much hardware each stage gets.

Defaults run on a laptop CPU with the tiny local test model; a GPU cluster is the same code with
VLM_MODEL_SOURCE=Qwen/Qwen2.5-VL-7B-Instruct, VLM_ENGINE=vllm and RAY_ADDRESS set.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.inference.vllm import CAPTION_VLLM, VllmSettings, vllm_settings
from video_assets.core.models.tiny_vlm import TINY_MODEL_NAME

# Built locally; random weights, nonsense captions.
TINY_MODEL_SOURCE = TINY_MODEL_NAME

# The vLLM settings that are fields of their own (so an environment variable can set them), by variable.
SIZING_FIELDS = {
    "tensor_parallel_size": "VLM_TENSOR_PARALLEL_SIZE",
    "gpu_memory_utilization": "VLM_GPU_MEMORY_UTILIZATION",
    "max_num_seqs": "VLM_MAX_NUM_SEQS",
    "accelerator_type": "VLM_ACCELERATOR_TYPE",
}


class VlmSettings(ConfigurableResource):
    model_source: str = Field(
        default=TINY_MODEL_SOURCE,
        description="Hub id (e.g. Qwen/Qwen2.5-VL-7B-Instruct), a local folder of weights, or "
        f"'{TINY_MODEL_SOURCE}' for the locally built random test model",
    )
    model_revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit)")
    registered_model: str = Field(default="video-captioner", description="MLflow registered model name")
    alias: str = Field(default="production", description="Alias the captions asset loads")
    engine: str = Field(
        default="auto",
        description="auto | transformers | vllm | endpoint (an OpenAI-compatible server: VLM_ENDPOINT_URL)",
    )
    cache_dir: str = Field(description="Where models are built, downloaded and unpacked")
    device: str = Field(default="auto", description="transformers device: auto | cpu | cuda")
    cpu_concurrency: int = Field(default=2, ge=1, description="Parallel decode+sample tasks (1 CPU each)")
    concurrency: int = Field(
        default=1,
        ge=1,
        description="Model actors, each holding one engine (vLLM: engines of tensor_parallel_size GPUs), all "
        "started with the job (VLM_CONCURRENCY)",
    )
    batch_size: int = Field(default=4, ge=1, description="transformers: segments per generate call")
    num_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs each transformers actor reserves in Ray; unset: 1 when the cluster has GPUs and "
        "device is not cpu, else 0",
    )
    decode_resources: dict[str, float] = Field(
        default={}, description="Ray custom resources each decode task requires (pins decoding to some nodes)"
    )
    model_resources: dict[str, float] = Field(
        default={}, description="Ray custom resources each model actor requires (pins the engines to some nodes)"
    )
    max_new_tokens: int = Field(default=128, ge=1)
    warm_engine_idle_s: float = Field(
        default=300.0,
        ge=0,
        description="On a Ray cluster that outlives the step (RAY_ADDRESS, or `video-assets ray up`): the caption model "
        "is a Ray Serve application (transformers; vLLM through ray.serve.llm) whose replicas scale to zero after "
        "this many seconds without requests (0: engines inside each job instead, vLLM's batch mode)",
    )
    endpoint_url: str = Field(
        default="",
        description="VLM_ENGINE=endpoint: the OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1 "
        "(VLM_ENDPOINT_URL); registered by vlm_model, without credentials",
    )
    endpoint_model: str = Field(
        default="", description="VLM_ENGINE=endpoint: the model the server serves (VLM_ENDPOINT_MODEL)"
    )
    endpoint_api_key: str = Field(
        default="", description="VLM_ENGINE=endpoint: bearer key (VLM_ENDPOINT_API_KEY); never logged"
    )
    endpoint_video: bool = Field(
        default=False,
        description="VLM_ENGINE=endpoint: the server takes a video part (vLLM's OpenAI server does: VLM_ENDPOINT_VIDEO=1), "
        "so each segment is sent as the in-job engines' request (one video, its frames' timing as video_metadata); "
        "off, one image part per frame with its time in the text (servers without video, e.g. hosted APIs)",
    )
    endpoint_qps: int | None = Field(
        default=None,
        ge=1,
        description="VLM_ENGINE=endpoint: requests per second per request-stage actor (None: no limit)",
    )
    endpoint_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="VLM_ENGINE=endpoint: seconds for a whole answer (VLM_REQUEST_TIMEOUT_S); a request that "
        "times out is the segment's error row, not sent again",
    )
    max_error_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="The captions check blocks a batch (nothing downstream runs for it) when more than this share "
        "of the segments sent to the engine are error rows (VLM_MAX_ERROR_SHARE); files that could not be probed or "
        "decoded do not count",
    )
    # vLLM engine sizing, one field each so that an environment variable can set it (sensor-launched runs
    # take no run config); unset, the `vllm` mapping's value or its default.
    tensor_parallel_size: int | None = Field(
        default=None, ge=1, description="vLLM: GPUs per engine (VLM_TENSOR_PARALLEL_SIZE); unset: `vllm`'s, else 1"
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="vLLM: share of each GPU's memory an engine takes (VLM_GPU_MEMORY_UTILIZATION); unset: "
        "`vllm`'s, else 0.9",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="vLLM: requests an engine runs at once (VLM_MAX_NUM_SEQS); unset: `vllm`'s, else 64",
    )
    accelerator_type: str = Field(
        default="",
        description='vLLM: the GPU type engines are placed on, as Ray names it, e.g. "H100" (VLM_ACCELERATOR_TYPE); '
        "empty: `vllm`'s, else any",
    )
    vllm: dict[str, Any] = Field(
        default={},
        description="vLLM engine settings over the captioning defaults: any field of the `vllm` table "
        '(docs/configuration.md), e.g. {"tensor_parallel_size": 2, "accelerator_type": "H100"}; a misspelt '
        "name is an error",
    )

    def vllm_settings(self, model_path: str) -> VllmSettings:
        """The vLLM engine settings of the captioning stage, for the model downloaded to ``model_path``. A
        sizing field and the `vllm` mapping that set one setting differently are a ValueError naming both."""
        sizing = {k: v for k in SIZING_FIELDS if (v := getattr(self, k)) not in (None, "")}
        if clash := [k for k, v in sizing.items() if k in self.vllm and self.vllm[k] != v]:
            raise ValueError(
                "; ".join(
                    f"{k} is {sizing[k]!r} (vlm.{k}, {SIZING_FIELDS[k]}) and {self.vllm[k]!r} (vlm.vllm): set one"
                    for k in clash
                )
            )
        shared = dict(concurrency=self.concurrency, max_new_tokens=self.max_new_tokens, **sizing)
        return vllm_settings(model_path, {**CAPTION_VLLM, **shared}, self.vllm)

    @property
    def uses_endpoint(self) -> bool:
        return self.engine.strip().lower() == "endpoint"

    @property
    def is_tiny(self) -> bool:
        return self.model_source == TINY_MODEL_SOURCE and not self.uses_endpoint

    @property
    def registered_source(self) -> str:
        """What ``vlm_model`` registers: the endpoint and model, or VLM_MODEL_SOURCE."""
        return endpoint_source(self.endpoint_url, self.endpoint_model) if self.uses_endpoint else self.model_source

    def endpoint(self, registered: dict[str, str]) -> dict:
        """``core.inference.endpoint.Endpoint`` fields for the endpoint a registered version names
        (``registered``: its url and model), with this instance's key and limits."""
        return {
            "url": registered["url"],
            "model": registered["model"],
            "api_key": self.endpoint_api_key,
            "qps": self.endpoint_qps,
            "timeout_s": self.endpoint_timeout_s,
            "batch_size": self.batch_size,
            "concurrency": self.concurrency,
            "video": self.endpoint_video,
        }

    def materialize_source(self) -> tuple[Path, str]:
        """A local folder holding the model, and a fingerprint identifying its exact content. With
        VLM_ENGINE=endpoint, a folder holding only ``config.json`` naming the endpoint and its model: the
        registry's versions and aliases (and every row's lineage) then say which served model answered."""
        if self.uses_endpoint:
            from video_assets.core.inference.endpoint import check_url

            url = check_url(self.endpoint_url)
            if not self.endpoint_model.strip():
                raise ValueError("VLM_ENGINE=endpoint needs VLM_ENDPOINT_MODEL: the model the server serves")
            config = {"model_type": ENDPOINT_MODEL_TYPE, "endpoint_url": url, "endpoint_model": self.endpoint_model}
            folder = Path(self.cache_dir) / "endpoints" / hashlib.sha256(json.dumps(config).encode()).hexdigest()[:16]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
            return folder, f"endpoint:{endpoint_source(url, self.endpoint_model)}"
        if self.is_tiny:
            from video_assets.core.models.tiny_vlm import build_tiny_qwen25_vl

            folder = build_tiny_qwen25_vl(Path(self.cache_dir) / TINY_MODEL_SOURCE)
            return folder, f"local:{TINY_MODEL_SOURCE}:{folder_digest(folder)}"
        local = Path(self.model_source).expanduser()
        if local.exists():
            if not (local / "config.json").exists():
                raise ValueError(f"model folder {local} has no config.json (VLM_MODEL_SOURCE)")
            return local.resolve(), f"local:{folder_digest(local)}"
        if looks_like_path(self.model_source):  # a hub id is never absolute, ./relative or ~
            raise FileNotFoundError(
                f"model folder {local} does not exist; set VLM_MODEL_SOURCE to an existing folder of weights "
                "(or a hub id)"
            )
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(
                    self.model_source, revision=self.model_revision, cache_dir=str(Path(self.cache_dir) / "hub")
                )
            )
        except Exception as exc:
            raise RuntimeError(
                f"could not fetch model {self.model_source!r} (revision {self.model_revision or 'main'}) from the hub: "
                f"{exc.__class__.__name__}: {exc}. Point VLM_MODEL_SOURCE at a local folder of weights when offline."
            ) from exc
        return path, f"hub:{self.model_source}@{path.name}"  # snapshot folders are named by commit


ENDPOINT_MODEL_TYPE = "openai-compatible-endpoint"


def endpoint_source(url: str, model: str) -> str:
    return f"{url.strip().rstrip('/')}#{model.strip()}"


def registered_endpoint(model_path: str | Path) -> dict[str, str] | None:
    """The endpoint (url, model) a registered version names, or None for a version holding weights."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("model_type") != ENDPOINT_MODEL_TYPE:
        return None
    return {"url": config["endpoint_url"], "model": config["endpoint_model"]}


def looks_like_path(source: str) -> bool:
    """A model source meant as a local folder, not a hub id (``org/name``)."""
    return source.startswith(("/", "./", "../", "~", ".\\")) or source in (".", "..") or "\\" in source


def folder_digest(folder: Path) -> str:
    """Content identity of a model folder without reading gigabytes: names, sizes, and config files' bytes."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        rel = p.relative_to(folder).as_posix()
        h.update(json.dumps([rel, p.stat().st_size]).encode())
        if p.suffix in {".json", ".txt", ".jinja", ".model"}:
            h.update(p.read_bytes())
    return h.hexdigest()[:16]
