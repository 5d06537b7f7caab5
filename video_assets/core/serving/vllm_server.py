"""The two classes of the served vLLM application (``core.serving.llm``), on Ray Serve LLM's public classes:

- ``NodeLocalServer``: Ray Serve LLM's ``LLMServer`` that first fetches and verifies the registered model on
  its own node (``ModelFiles.here``, the model cache every engine uses), then opens that copy: no folder
  shared between nodes, and a Dagster outside the cluster gets the served model too.
- ``KeyedIngress``: Ray Serve LLM's OpenAI ingress answering only requests that carry the instance's serve key
  (as the transformers application's route, ``captioner.CaptionerReplica``); 401 otherwise.

Imported only where vLLM is served (Ray Serve LLM's classes import vLLM). No ``from __future__ import
annotations``: FastAPI reads the route methods' annotations (``Request``) at run time."""

import asyncio
import functools
import inspect

from fastapi import HTTPException, Request
from ray.serve.llm.deployment import LLMServer
from ray.serve.llm.ingress import OpenAiIngress

from video_assets.core.serving.captioner import bearer_ok

MODEL_KEY = "video_assets_model"  # the LLMConfig's experimental_configs entry: the registered model's files


class NodeLocalServer(LLMServer):
    """``LLMServer`` on this node's verified copy of the registered model (``experimental_configs[MODEL_KEY]``,
    ``ModelFiles`` fields): fetched here before the engine starts, so a replica starts on any node."""

    async def __init__(self, llm_config, **kwargs):
        from video_assets.core.inference.model_cache import ModelFiles

        files = ModelFiles(**llm_config.experimental_configs[MODEL_KEY])
        path = await asyncio.to_thread(files.here)  # downloads and hashes: off the replica's event loop
        config = llm_config.model_copy(deep=True)
        config.model_loading_config.model_source = path
        await super().__init__(config, **kwargs)


def _keyed(method):
    """``method`` (a route of the ingress taking the ``request``) refused without the serve key."""

    @functools.wraps(method)  # FastAPI reads the route's parameters through __wrapped__
    async def checked(self, *args, **kwargs):
        request = kwargs.get("request") or next((a for a in args if isinstance(a, Request)), None)
        self._authorise(request)
        return await method(self, *args, **kwargs)

    return checked


class KeyedIngress(OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress, each route refused (401) without ``key_sha256``'s bearer key; with an
    empty digest, none is asked."""

    def __init__(self, *args, key_sha256: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._key = key_sha256

    def _authorise(self, request) -> None:
        if not bearer_ok(request.headers.get("authorization", "") if request is not None else "", self._key):
            raise HTTPException(401, "a bearer key is required (the instance's serve key)")

    async def models(self, request: Request):
        self._authorise(request)
        return await super().models()

    async def model_data(self, model: str, request: Request):
        self._authorise(request)
        return await super().model_data(model)


# Every other route of the ingress takes the request (chat, completions, embeddings, tokenize...): each checked,
# including routes a later Ray adds.
for _name, _method in inspect.getmembers(OpenAiIngress, inspect.iscoroutinefunction):
    if _name not in ("models", "model_data") and "request" in inspect.signature(_method).parameters:
        setattr(KeyedIngress, _name, _keyed(_method))
