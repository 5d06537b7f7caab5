"""structured_events rows from a structuring engine's answers, and their one-commit replacement per video."""

from datetime import UTC, datetime

from resources.delta import DeltaTables
from resources.structurer import StructurerSettings
from video_assets.core.captioning.versions import caption_digest
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.policy import structure_captions
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
