"""Model runtimes shared by captioning and structuring: which engine runs (``choose_engine_name``),
the transformers generation helper (``hf``) and the vLLM settings and row conversions (``vllm``).

- ``transformers``: CPU or one GPU, inside a Ray Data actor (captions) or the step (structuring).
- ``vllm``: Ray Data LLM's vLLM processor, GPU clusters.
- ``endpoint``: an OpenAI-compatible server (``endpoint``), through its request stage (``EndpointRequests``).

Importing this package imports neither torch, transformers nor vLLM.
"""

from __future__ import annotations

import importlib.util

ENGINE_NAMES = ("transformers", "vllm", "endpoint")

__all__ = [
    "ENGINE_NAMES",
    "choose_engine_name",
    "cuda_visible",
    "vllm_importable",
    "vllm_on_this_node",
]


def vllm_importable() -> bool:
    """Whether ``import vllm`` would find the package (checked without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_on_this_node() -> bool:
    """``vllm_importable`` as a Ray task runs it on a cluster node (shipped by reference: the node's own check)."""
    return vllm_importable()


def cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:
        return False


def choose_engine_name(requested: str | None, gpus: float | None = None, has_vllm=None) -> str:
    """Which engine runs. ``"auto"``/None -> ``"vllm"`` only when GPUs are there AND vLLM imports where they
    are: ``gpus`` of the Ray cluster when the caller knows it, with ``has_vllm()`` (asked only then: a GPU
    node of that cluster, not this process, which may be a CPU-only orchestrator without vLLM); else a
    CUDA GPU and vLLM in this process. An explicit ``"transformers"``, ``"vllm"`` or ``"endpoint"`` is
    returned as asked (the vLLM stage may run on cluster GPUs this process cannot see); anything else is a
    ValueError.
    """
    name = (requested or "auto").strip().lower()
    if name == "auto":
        if gpus is None:
            return "vllm" if cuda_visible() and vllm_importable() else "transformers"
        return "vllm" if gpus > 0 and (has_vllm or vllm_importable)() else "transformers"
    if name not in ENGINE_NAMES:
        raise ValueError(
            f"unknown engine {requested!r}; expected auto, {', '.join(ENGINE_NAMES[:-1])} or {ENGINE_NAMES[-1]}"
        )
    return name
