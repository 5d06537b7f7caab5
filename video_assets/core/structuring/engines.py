"""Structuring engines: the same ``generate(list[StructureRequest])`` on transformers + xgrammar
(CPU or one GPU) and on vLLM structured outputs through Ray Data LLM (GPU clusters)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from video_assets.core.inference import vllm
from video_assets.core.inference.model_cache import ModelFiles, place_on_every_node
from video_assets.core.inference.retries import tolerate_failed_batches
from video_assets.core.inference.service_runner import on_cluster
from video_assets.core.structuring.policy import StructureRequest, StructureResponse

log = logging.getLogger(__name__)


# -- transformers + xgrammar --------------------------------------------------------------------------


GRAMMAR_CACHE = 256  # compiled grammars kept per engine, oldest dropped first


class TransformersStructurer:
    """Greedy, grammar-constrained generation with transformers. Loads a VLM folder (text-only chat)
    or a causal text model. A fresh xgrammar logits processor per ``generate`` call (it is stateful)."""

    name = "transformers"
    speculative_retry = False  # a loaded model: a retry costs only its own (short) generation

    def __init__(self, model_path: str | None = None, device: str = "auto", batch_size: int = 4, loaded=None):
        import xgrammar as xgr

        from video_assets.core.inference import hf

        # ``loaded``: a model another engine already holds (the warm caption engine), not loaded again.
        self.loaded = loaded if loaded is not None else hf.load(model_path, device)
        self.device, self.tokenizer, self.model = self.loaded.device, self.loaded.tokenizer, self.loaded.model
        self.batch_size = max(1, int(batch_size))
        # The grammar's vocabulary must match the logits' width, which can exceed len(tokenizer).
        vocab = self.model.get_output_embeddings().weight.shape[0]
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=vocab, stop_token_ids=sorted(self.loaded.eos_ids)
        )
        self._compiler = xgr.GrammarCompiler(info)
        self._grammars: dict[str, Any] = {}
        self._xgr = xgr

    def _grammar(self, schema: dict):
        key = json.dumps(schema, sort_keys=True)
        if key not in self._grammars:
            if len(self._grammars) >= GRAMMAR_CACHE:  # a warm engine sees a schema per clip window
                self._grammars.pop(next(iter(self._grammars)))
            # Compiled in the schema's own property order (verdict first), cached by its sorted form.
            self._grammars[key] = self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self._grammars[key]

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        out: list[StructureResponse] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            try:
                out += self._run(chunk)
            except Exception as exc:  # one bad batch costs only its own rows
                log.warning("structuring batch failed: %s: %s", type(exc).__name__, exc)
                out += [StructureResponse(r.request_id, "", error=f"{type(exc).__name__}: {exc}") for r in chunk]
        return out

    def _run(self, reqs: list[StructureRequest]) -> list[StructureResponse]:
        from video_assets.core.inference import hf

        started = time.perf_counter()
        chat = self.loaded.chat
        texts = [chat.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in reqs]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        # A grammar per row: each caption's schema bounds its events by its own clip, and rows of
        # different clips (or a first pass and a retry) still share one generate call.
        processor = self._xgr.contrib.hf.LogitsProcessor([self._grammar(r.schema) for r in reqs])
        generated = hf.greedy(self.loaded, enc, max(r.max_new_tokens for r in reqs), logits_processor=[processor])
        latency = time.perf_counter() - started
        responses = []
        for r, ids in zip(reqs, generated):
            text, n_out = hf.completion(self.loaded, ids, r.max_new_tokens)
            responses.append(StructureResponse(r.request_id, text, n_out, latency / len(reqs)))
        return responses


# -- vLLM through Ray Data LLM ---------------------------------------------------------------------

REQUEST_KEY = "structure_request_id"


def to_vllm_row(req: StructureRequest) -> dict[str, Any]:
    """A request as a Ray Data LLM row: Ray's vLLM stage turns ``sampling_params.structured_outputs``
    into ``vllm.sampling_params.StructuredOutputsParams(json=...)``."""
    return {
        REQUEST_KEY: req.request_id,
        "messages": req.messages,
        "sampling_params": vllm.sampling_params(req.max_new_tokens, json_schema=req.schema),
    }


def from_vllm_row(row: dict[str, Any]) -> StructureResponse:
    out = vllm.read_output(row)
    return StructureResponse(str(row.get(REQUEST_KEY, "")), out.text, out.output_tokens, out.latency_s, out.error)


def _vllm_rows(settings: vllm.VllmSettings, items: list[dict], fetch: ModelFiles | None = None):
    """The vLLM processor's output rows for ``items`` (a batch that failed on every try: none, and the
    caller's "no output" rows). ``fetch``: the model each stage fetches on its node (``vllm.fetch_model_on_nodes``)."""
    import ray
    from ray.data.llm import build_processor

    processor = vllm.bounded_engine_retries(
        build_processor(
            vllm.processor_config(settings, multimodal=False),
            preprocess=lambda row: {**row, "sampling_params": json.loads(row["sampling_params_json"])},
            postprocess=lambda row: {REQUEST_KEY: row[REQUEST_KEY], **vllm.output_columns(row)},
        )
    )
    if fetch is not None:
        processor = vllm.fetch_model_on_nodes(processor, fetch)
    yield from tolerate_failed_batches(processor(ray.data.from_items(items))).take_all()


class VllmStructurer:
    """Structured outputs on GPU workers via ``ray.data.llm`` (and on CPU with vLLM's CPU build,
    ``make test-vllm-cpu``). Each ``generate`` is one engine lifetime, so the policy sends the retry
    requests with the first pass (``speculative_retry``)."""

    name = "vllm"
    speculative_retry = True

    def __init__(self, settings: vllm.VllmSettings, model: ModelFiles | None = None):
        self.settings = settings
        self.model = model  # a registered model: placed on every node before the engine starts

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        if not requests:
            return []

        settings, fetch = self.settings, None
        if self.model is not None:
            placed = place_on_every_node(self.model)
            settings = settings.model_copy(update={"model_source": placed.path})
            fetch = self.model if placed.per_node else None
        # sampling_params travel as JSON: their nested dicts differ between requests (schemas).
        items = [
            {**(r := to_vllm_row(q)), "sampling_params_json": json.dumps(r.pop("sampling_params"))} for q in requests
        ]
        rows = on_cluster(_vllm_rows, settings, items, fetch)
        by_id = {str(row[REQUEST_KEY]): from_vllm_row(row) for row in rows}
        return [
            by_id.get(q.request_id, StructureResponse(q.request_id, "", error="no output from vLLM")) for q in requests
        ]


# -- an OpenAI-compatible endpoint through the request stage (core.inference.endpoint) ----------------------


def structure_payload(model: str, req: StructureRequest) -> dict[str, Any]:
    """A chat completion constrained to the request's JSON schema (OpenAI ``response_format``; vLLM's server
    decodes with it as structured outputs)."""
    return {
        "model": model,
        "messages": req.messages,
        "max_tokens": int(req.max_new_tokens),
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "structured", "schema": req.schema}},
    }


def _endpoint_rows(endpoint, items: list[dict]):
    import ray

    from video_assets.core.inference.endpoint import PAYLOAD, RESPONSE, request_stage
    from video_assets.core.inference.vllm import ERROR_KEY

    keep = (REQUEST_KEY, RESPONSE, ERROR_KEY, "endpoint_s")
    ds = request_stage(
        ray.data.from_items(items),
        endpoint,
        preprocess=lambda row: {PAYLOAD: row["request_json"], ERROR_KEY: ""},
        postprocess=lambda row: {k: row.get(k) for k in keep},
    )
    yield from tolerate_failed_batches(ds).take_all()


class EndpointStructurer:
    """Structuring on the captioning endpoint (``VLM_ENGINE=endpoint`` with ``STRUCTURER_MODEL=captioner``):
    one request per caption with the use case's JSON schema. The server is already up, so a retry costs only
    its own request: the retry pass goes only for the rows whose first pass failed."""

    speculative_retry = False

    def __init__(self, endpoint: dict, name: str | None = None):
        from video_assets.core.inference.endpoint import Endpoint

        self.endpoint = Endpoint(**endpoint)
        self.name = name or f"endpoint {self.endpoint.url} ({self.endpoint.model})"

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        if not requests:
            return []
        items = [
            {REQUEST_KEY: q.request_id, "request_json": json.dumps(structure_payload(self.endpoint.model, q))}
            for q in requests
        ]
        rows = on_cluster(_endpoint_rows, self.endpoint, items)
        return answered(requests, rows, "no answer from the endpoint after every try (see the Ray logs)")


def answered(requests: list[StructureRequest], rows, missing: str) -> list[StructureResponse]:
    """One response per request, in order, from a chat job's answer rows keyed by ``REQUEST_KEY`` (an OpenAI
    answer, an error answer or Ray's error row, as ``inference.endpoint.read_answer`` reads them); a request
    no row answered gets ``missing`` as its error (its batch failed every try)."""
    from video_assets.core.inference.endpoint import read_answer

    by_id = {}
    for row in rows:
        answer = read_answer(row)
        rid = str(row.get(REQUEST_KEY, ""))
        by_id[rid] = StructureResponse(rid, answer.text, answer.output_tokens, answer.latency_s, answer.error)
    return [by_id.get(q.request_id, StructureResponse(q.request_id, "", error=missing)) for q in requests]
