"""Prose -> schema-conforming rows: constrained decoding, one simpler retry, never a missing row.

``structure_captions`` is the whole policy and is engine-agnostic:
1. every ``ok`` caption is decoded under the use case's finite JSON schema (``usecase.decode_schema``)
   and validated with its pydantic model;
2. a caption whose output fails validation (or whose request failed) gets ONE retry: a classification
   call constrained to the verdict enum -> ``status=retried`` (verdict only, no confidence, no events);
3. what still fails is ``status=unparsed`` with both raw outputs and the reasons;
4. a caption that is itself an error (or empty) is ``status=no_caption``.

Engines: ``TransformersStructurer`` (CPU or one GPU; xgrammar logits processor) and
``VllmStructurer`` (Ray Data LLM + vLLM structured outputs, which use the same xgrammar).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from video_assets import usecase as uc_mod
from video_assets.usecase import UseCase

log = logging.getLogger(__name__)

STATUSES = ("parsed", "retried", "unparsed", "no_caption")


@dataclass
class StructureRequest:
    request_id: str
    messages: list[dict[str, str]]
    schema: dict[str, Any]
    max_new_tokens: int


@dataclass
class StructureResponse:
    request_id: str
    text: str
    output_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


class Structurer(Protocol):
    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]: ...


def structure_captions(
    engine: Structurer, uc: UseCase, captions: Iterable[dict], max_new_tokens: int, retry_max_new_tokens: int
) -> list[dict]:
    """One result row per caption, in input order (see the module docstring for the statuses)."""
    captions = list(captions)
    results: list[dict | None] = [None] * len(captions)
    first: list[tuple[int, StructureRequest]] = []
    schema = uc_mod.decode_schema(uc)
    for i, c in enumerate(captions):
        if c.get("status") != "ok" or not (c.get("prose") or "").strip():
            results[i] = _row("no_caption", attempts=0, error=f"no caption to structure: {c.get('error') or 'empty prose'}")
            continue
        msgs = uc_mod.messages(uc, c["prose"], c.get("segment_start_s"), c.get("segment_end_s"))
        first.append((i, StructureRequest(f"{i}", msgs, schema, max_new_tokens)))

    retry: list[tuple[int, StructureResponse, str, StructureRequest]] = []
    for (i, _), resp in zip(first, engine.generate([r for _, r in first])):
        record, why = (None, f"request failed: {resp.error}") if resp.error else uc_mod.parse(uc, resp.text)
        if record is not None:
            results[i] = _row(
                "parsed", attempts=1, verdict=record.verdict, confidence=record.confidence,
                events=[e.model_dump() for e in record.events], rationale=record.rationale,
                raw_output=resp.text, output_tokens=resp.output_tokens, latency_s=resp.latency_s,
            )
        else:
            req = StructureRequest(f"{i}:retry", uc_mod.classify_messages(uc, captions[i]["prose"]),
                                   uc_mod.classify_schema(), retry_max_new_tokens)
            retry.append((i, resp, why, req))

    for (i, resp, why, _), again in zip(retry, engine.generate([r for *_, r in retry])):
        verdict, why2 = (None, f"request failed: {again.error}") if again.error else uc_mod.parse_verdict(again.text)
        common = dict(attempts=2, raw_output=resp.text, retry_output=again.text,
                      output_tokens=resp.output_tokens + again.output_tokens, latency_s=resp.latency_s + again.latency_s)
        if verdict is not None:
            results[i] = _row("retried", verdict=verdict, error=f"first pass: {why}", **common)
        else:
            results[i] = _row("unparsed", error=f"first pass: {why}; retry: {why2}", **common)
    return results  # type: ignore[return-value]


def _row(status: str, **fields) -> dict:
    base = {"status": status, "verdict": None, "confidence": None, "events": [], "rationale": None,
            "raw_output": None, "retry_output": None, "error": None, "attempts": 0,
            "output_tokens": 0, "latency_s": 0.0}
    return {**base, **fields}


# -- transformers + xgrammar --------------------------------------------------------------------------


class TransformersStructurer:
    """Greedy, grammar-constrained generation with transformers. Loads a VLM folder (text-only chat)
    or a causal text model. A fresh xgrammar logits processor per ``generate`` call (it is stateful)."""

    name = "transformers"

    def __init__(self, model_path: str, device: str = "auto", batch_size: int = 4):
        import torch
        import xgrammar as xgr
        from transformers import AutoConfig, AutoProcessor, AutoTokenizer

        from video_assets.engines.transformers_engine import _resolve_device, _resolve_dtype

        self.device = _resolve_device(device)
        self.batch_size = max(1, int(batch_size))
        config = AutoConfig.from_pretrained(model_path)
        is_vlm = hasattr(config, "vision_config")
        if is_vlm:
            from transformers import AutoModelForImageTextToText as Auto

            # The processor carries the chat template of a VLM checkpoint.
            self._chat = AutoProcessor.from_pretrained(model_path)
            self.tokenizer = self._chat.tokenizer
        else:
            from transformers import AutoModelForCausalLM as Auto

            self.tokenizer = self._chat = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        self.model = Auto.from_pretrained(model_path, dtype=_resolve_dtype("auto", self.device)).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = self.tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(iter(self.eos_ids))
        # The grammar's vocabulary must match the logits' width, which can exceed len(tokenizer).
        vocab = self.model.get_output_embeddings().weight.shape[0]
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab, stop_token_ids=sorted(self.eos_ids))
        self._compiler = xgr.GrammarCompiler(info)
        self._grammars: dict[str, Any] = {}
        self._xgr = xgr
        self._torch = torch

    def _grammar(self, schema: dict):
        key = json.dumps(schema, sort_keys=True)
        if key not in self._grammars:
            # Compiled in the schema's own property order (verdict first), cached by its sorted form.
            self._grammars[key] = self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self._grammars[key]

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        out: list[StructureResponse] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start : start + self.batch_size]
            # One schema per batch (the caller sends one kind at a time); split if mixed.
            groups: dict[str, list[StructureRequest]] = {}
            for r in chunk:
                groups.setdefault(json.dumps(r.schema, sort_keys=True), []).append(r)
            done = {}
            for reqs in groups.values():
                try:
                    for r, resp in zip(reqs, self._run(reqs)):
                        done[r.request_id] = resp
                except Exception as exc:  # one bad batch costs only its own rows
                    log.warning("structuring batch failed: %s: %s", type(exc).__name__, exc)
                    for r in reqs:
                        done[r.request_id] = StructureResponse(r.request_id, "", error=f"{type(exc).__name__}: {exc}")
            out += [done[r.request_id] for r in chunk]
        return out

    def _run(self, reqs: list[StructureRequest]) -> list[StructureResponse]:
        torch = self._torch
        started = time.perf_counter()
        texts = [self._chat.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in reqs]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        processor = self._xgr.contrib.hf.LogitsProcessor(self._grammar(reqs[0].schema))
        with torch.inference_mode():
            gen = self.model.generate(
                **enc, max_new_tokens=max(r.max_new_tokens for r in reqs), do_sample=False,
                temperature=None, top_p=None, top_k=None, pad_token_id=self.pad_id, logits_processor=[processor],
            )
        latency = time.perf_counter() - started
        responses = []
        for r, ids in zip(reqs, gen[:, enc["input_ids"].shape[1]:].tolist()):
            kept = []
            for tid in ids[: r.max_new_tokens]:
                if tid in self.eos_ids:
                    break
                kept.append(tid)
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            responses.append(StructureResponse(r.request_id, text, len(kept), latency / len(reqs)))
        return responses


# -- vLLM through Ray Data LLM ---------------------------------------------------------------------

REQUEST_KEY = "structure_request_id"


def to_vllm_row(req: StructureRequest) -> dict[str, Any]:
    """A request as a Ray Data LLM row: Ray's vLLM stage turns ``sampling_params.structured_outputs``
    into ``vllm.sampling_params.StructuredOutputsParams(json=...)``."""
    return {
        REQUEST_KEY: req.request_id,
        "messages": req.messages,
        "sampling_params": {"max_tokens": int(req.max_new_tokens), "temperature": 0.0,
                            "structured_outputs": {"json": json.dumps(req.schema)}},
    }


def from_vllm_row(row: dict[str, Any]) -> StructureResponse:
    error = row.get("__inference_error__") or None
    return StructureResponse(
        request_id=str(row.get(REQUEST_KEY, "")),
        text="" if error else str(row.get("generated_text") or ""),
        output_tokens=int(row.get("num_generated_tokens") or 0),
        latency_s=float(row.get("time_taken_llm") or 0.0),
        error=str(error) if error else None,
    )


def vllm_processor_config(model_source: str, settings: dict[str, Any]):
    from ray.data.llm import vLLMEngineProcessorConfig

    return vLLMEngineProcessorConfig(
        model_source=model_source,
        engine_kwargs={
            "tensor_parallel_size": settings.get("tensor_parallel_size", 1),
            "gpu_memory_utilization": settings.get("gpu_memory_utilization", 0.9),
            "max_model_len": settings.get("max_model_len", 8192),
            "structured_outputs_config": {"backend": "xgrammar"},
            # A VLM used as a text model: no image or video slots to reserve.
            "limit_mm_per_prompt": {"image": 0, "video": 0},
        },
        concurrency=settings.get("concurrency", 1),
        batch_size=settings.get("batch_size", 16),
        should_continue_on_error=True,
        chat_template_stage=True,
        tokenize_stage=True,
        detokenize_stage=True,
    )


class VllmStructurer:
    """Structured outputs on GPU workers via ``ray.data.llm``. Not exercised on CPU machines."""

    name = "vllm"

    def __init__(self, model_source: str, settings: dict[str, Any] | None = None):
        self.model_source = model_source
        self.settings = settings or {}

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        if not requests:
            return []
        import ray
        from ray.data.llm import build_processor

        processor = build_processor(
            vllm_processor_config(self.model_source, self.settings),
            preprocess=lambda row: {**row, "sampling_params": json.loads(row["sampling_params_json"])},
            postprocess=lambda row: {REQUEST_KEY: row[REQUEST_KEY], "__inference_error__": row.get("__inference_error__"),
                                     "generated_text": row.get("generated_text"),
                                     "num_generated_tokens": row.get("num_generated_tokens"),
                                     "time_taken_llm": row.get("time_taken_llm")},
        )
        # sampling_params travel as JSON: their nested dicts differ between requests (schemas).
        items = [{**(r := to_vllm_row(q)), "sampling_params_json": json.dumps(r.pop("sampling_params"))} for q in requests]
        by_id = {str(row[REQUEST_KEY]): from_vllm_row(row) for row in processor(ray.data.from_items(items)).take_all()}
        return [by_id.get(q.request_id, StructureResponse(q.request_id, "", error="no output from vLLM")) for q in requests]
