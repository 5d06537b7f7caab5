"""structured_events rows from a structuring engine's answers, and their one-commit replacement per video."""

from dataclasses import replace
from datetime import UTC, datetime

from resources.delta import DeltaTables
from resources.structurer import StructurerSettings
from video_assets.core.captioning.versions import caption_digest
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.policy import StructureRequest, StructureResponse, structure_captions
from video_assets.core.structuring.versions import StructuringPlan
from video_assets.core.tables import KEYS, to_arrow
from video_assets.core.uploads.discovery import printable


def structure_rows(
    engine, settings: StructurerSettings, uc: uc_mod.UseCase, caption_rows: list[dict], structurer: str, log=None
) -> list[dict]:
    """structured_events rows for caption rows (dicts of the captions table), one per caption."""
    now = datetime.now(UTC)
    results = structure_captions(engine, uc, caption_rows, settings.max_new_tokens, settings.retry_max_new_tokens)
    out = []
    for n, (c, r) in enumerate(zip(caption_rows, results), start=1):
        if log is not None:
            name = printable(c["uri"].rsplit("/", 1)[-1])
            log.info(
                f"[{n}/{len(caption_rows)}] {uc.name} {name} segment {c['segment']}: {r['status']}"
                + (f" {r['verdict']}" if r["verdict"] else "")
                + (f" ({printable(r['error'])})" if r["error"] else "")
            )
        out.append(
            {
                "video_id": c["video_id"],
                "segment": c["segment"],
                "use_case": uc.name,
                "model_version": c["model_version"],
                "prompt_version": c["prompt_version"],
                "use_case_version": uc.version,
                "structurer": structurer,
                "batch_key": c["batch_key"],
                "uri": c["uri"],
                "segment_start_s": c.get("segment_start_s"),
                "segment_end_s": c.get("segment_end_s"),
                # plan_structuring's rows carry it; plain caption rows (any other caller) get it here
                "caption_digest": c.get("caption_digest") or caption_digest(c),
                **r,
                "n_events": len(r["events"]),
                "structured_at": now,
            }
        )
    return out


def structure_use_cases(
    engine, settings: StructurerSettings, work: list[tuple[uc_mod.UseCase, list[dict]]], structurer: str, log=None
) -> list[dict]:
    """``structure_rows`` of every (use case, caption rows) of a step. An engine whose every call is one engine
    lifetime (``speculative_retry``: vLLM in the job, its retries sent with the first pass) gets one call for all
    of them: each use case's requests are recorded, sent together, and its answers replayed into the same policy,
    so a batch starts one engine whatever the number of use cases (it started one per use case)."""
    work = [(uc, rows) for uc, rows in work if rows]
    if not getattr(engine, "speculative_retry", False) or len(work) < 2:
        return [row for uc, rows in work for row in structure_rows(engine, settings, uc, rows, structurer, log)]
    recorded = _Recorded()
    for uc, rows in work:
        recorded.use_case = uc.name
        structure_captions(recorded, uc, rows, settings.max_new_tokens, settings.retry_max_new_tokens)
    answers = {a.request_id: a for a in engine.generate(recorded.requests)} if recorded.requests else {}
    out = []
    for uc, rows in work:
        recorded.use_case, recorded.answers = uc.name, answers
        out += structure_rows(recorded, settings, uc, rows, structurer, log)
    return out


class _Recorded:
    """A speculative engine's stand-in: first it records the requests of each use case's one call (answering
    nothing), then it answers them from the real engine's answers to all of them at once."""

    speculative_retry = True  # the policy then makes one call per use case, first pass and retries together

    def __init__(self):
        self.use_case, self.requests, self.answers = "", [], None

    def generate(self, requests: list[StructureRequest]) -> list[StructureResponse]:
        ids = [f"{self.use_case}/{q.request_id}" for q in requests]
        if self.answers is None:
            self.requests += [replace(q, request_id=i) for q, i in zip(requests, ids)]
            return [StructureResponse(q.request_id, "", error="not sent yet") for q in requests]
        missing = StructureResponse("", "", error="no answer from the engine")
        return [replace(self.answers.get(i, missing), request_id=q.request_id) for q, i in zip(requests, ids)]


def write_structured(
    tables: DeltaTables,
    table: str,
    plan: StructuringPlan,
    new_rows: list[dict],
    model_version: str,
    prompt_version: int,
) -> int:
    """The plan's affected videos' rows of one caption pair replaced in one commit (as captions replaces
    a video's rows): kept rows that still match their caption plus ``new_rows``; stale rows are gone.
    Rows written."""
    if not plan.affected:
        return 0
    rows = plan.rows(new_rows, KEYS[table])
    selection = {"video_id": plan.affected, "model_version": [model_version], "prompt_version": [prompt_version]}
    tables.replace_where(table, to_arrow(table, rows), selection)
    return len(rows)
