"""Prose -> schema-conforming rows: constrained decoding, one simpler retry, never a missing row.

``structure_captions`` is the whole policy and is engine-agnostic:
1. every ``ok`` caption is decoded under the use case's finite JSON schema (``usecase.decode_schema``)
   and validated with its pydantic model;
2. a caption whose output fails validation (or whose request failed) gets ONE retry: a classification
   call constrained to the verdict enum -> ``status=retried`` (verdict only, no confidence, no events);
3. what still fails is ``status=unparsed`` with both raw outputs and the reasons;
4. a caption that is itself an error (or empty) is ``status=no_caption``.

Engines (``engines.py``): ``TransformersStructurer`` (CPU or one GPU; xgrammar logits processor)
and ``VllmStructurer`` (Ray Data LLM + vLLM structured outputs, which use the same xgrammar).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.usecase import UseCase
from video_assets.core.vocabulary import CAPTION_OK, NO_CAPTION, PARSED, RETRIED, UNPARSED


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
    # True for engines whose start-up dominates (vLLM through Ray Data: one engine lifetime per call):
    # the retry requests then go out with the first pass, in one call, and are used only where needed.
    speculative_retry: bool

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]: ...


def structure_captions(
    engine: Structurer, uc: UseCase, captions: Iterable[dict], max_new_tokens: int, retry_max_new_tokens: int
) -> list[dict]:
    """One result row per caption, in input order (see the module docstring for the statuses)."""
    captions = list(captions)
    results: list[dict | None] = [None] * len(captions)
    first: list[tuple[int, StructureRequest]] = []
    for i, c in enumerate(captions):
        if c.get("status") != CAPTION_OK or not (c.get("prose") or "").strip():
            results[i] = _row(
                NO_CAPTION, attempts=0, error=f"no caption to structure: {c.get('error') or 'empty prose'}"
            )
            continue
        start_s, end_s = c.get("segment_start_s"), c.get("segment_end_s")
        msgs = uc_mod.messages(uc, c["prose"], start_s, end_s)
        schema = uc_mod.decode_schema(uc, start_s, end_s)  # event times bounded by this caption's clip
        first.append((i, StructureRequest(f"{i}", msgs, schema, max_new_tokens)))

    def retry_request(i: int) -> StructureRequest:
        return StructureRequest(
            f"{i}:retry",
            uc_mod.classify_messages(uc, captions[i]["prose"]),
            uc_mod.classify_schema(),
            retry_max_new_tokens,
        )

    speculative: dict[int, StructureResponse] = {}
    if getattr(engine, "speculative_retry", False) and first:
        both = engine.generate([r for _, r in first] + [retry_request(i) for i, _ in first])
        first_responses = both[: len(first)]
        speculative = {i: resp for (i, _), resp in zip(first, both[len(first) :])}
    else:
        first_responses = engine.generate([r for _, r in first])

    retry: list[tuple[int, StructureResponse, str, StructureRequest]] = []
    for (i, _), resp in zip(first, first_responses):
        record, why = (None, f"request failed: {resp.error}") if resp.error else uc_mod.parse(uc, resp.text)
        if record is not None:
            c = captions[i]
            record, outside = uc_mod.within_window(uc, record, c.get("segment_start_s"), c.get("segment_end_s"))
            results[i] = _row(
                PARSED,
                attempts=1,
                events_outside=len(outside),
                error=_outside_reason(uc, c, outside),
                verdict=record.verdict,
                confidence=record.confidence,
                events=[e.model_dump() for e in record.events],
                rationale=record.rationale,
                raw_output=resp.text,
                output_tokens=resp.output_tokens,
                latency_s=resp.latency_s,
            )
        else:
            retry.append((i, resp, why, retry_request(i)))

    agains = [speculative[i] for i, *_ in retry] if speculative else engine.generate([r for *_, r in retry])
    for (i, resp, why, _), again in zip(retry, agains):
        verdict, why2 = (None, f"request failed: {again.error}") if again.error else uc_mod.parse_verdict(again.text)
        common = dict(
            attempts=2,
            raw_output=resp.text,
            retry_output=again.text,
            output_tokens=resp.output_tokens + again.output_tokens,
            latency_s=resp.latency_s + again.latency_s,
        )
        if verdict is not None:
            results[i] = _row(RETRIED, verdict=verdict, error=f"first pass: {why}", **common)
        else:
            results[i] = _row(UNPARSED, error=f"first pass: {why}; retry: {why2}", **common)
    return results  # type: ignore[return-value]


def _row(status: str, **fields) -> dict:
    base = {
        "status": status,
        "verdict": None,
        "confidence": None,
        "events": [],
        "rationale": None,
        "raw_output": None,
        "retry_output": None,
        "error": None,
        "attempts": 0,
        "events_outside": 0,
        "output_tokens": 0,
        "latency_s": 0.0,
    }
    return {**base, **fields}


def _outside_reason(uc: UseCase, caption: dict, outside: list) -> str | None:
    """Why a parsed row has fewer events than the model wrote: the ones outside the caption's clip."""
    if not outside:
        return None
    lo, hi = uc_mod.window(uc, caption.get("segment_start_s"), caption.get("segment_end_s"))
    times = ", ".join(f"{e.start_s:g}-{e.end_s:g} s" for e in outside[:5])
    return f"dropped {len(outside)} event(s) outside the clip ({lo:g}-{hi:g} s): {times}"
