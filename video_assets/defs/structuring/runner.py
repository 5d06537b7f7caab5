"""Structuring runs, shared by the structured_events asset, routing and the promotion job: which
engine structures, under which id, and the rows it writes."""

from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from dagster import DataVersion

from resources.delta import DeltaTables
from resources.structurer import CAPTIONER, StructurerSettings
from video_assets.core.captioning.job import JobSpec
from video_assets.core.captioning.versions import caption_versions
from video_assets.core.inference import choose_engine_name, vllm_importable
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.policy import structure_captions
from video_assets.core.tables import SCHEMAS, STRUCTURED_EVENTS
from video_assets.core.vocabulary import ANSWERED
from video_assets.defs.captioning.runner import cluster_gpus


def structurer_id(settings: StructurerSettings, model_name: str, model_version: str) -> str:
    return f"{model_name}/v{model_version}" if settings.model == CAPTIONER else settings.model


def make_structurer(
    settings: StructurerSettings,
    captioner: ModelFiles | Path | str | None,
    connect_ray=None,
    warm: JobSpec | None = None,
):
    """The engine for ``settings`` (the captioning model's files when model is 'captioner').

    ``connect_ray()`` connects to Ray through the step's Ray resource and returns the cluster's GPU
    count; it is called only when vLLM could run (asked for, or ``auto`` with vLLM installed), so the
    CPU default never starts Ray for structuring. Without it, the GPUs this process sees decide.
    ``warm``: the captions step's warm engine (the step joined a Ray that outlives it); the
    'captioner' structurer on transformers then runs on that engine's loaded model, on its device,
    instead of loading the model again here."""
    files = captioner if isinstance(captioner, ModelFiles) or captioner is None else ModelFiles(str(captioner))
    if settings.model == CAPTIONER and files is None:
        raise ValueError("structuring with the captioning model needs its files")
    model = files.path if settings.model == CAPTIONER else settings.model
    requested = (settings.engine or "auto").strip().lower()
    gpus = None
    if requested == "vllm" or (requested == "auto" and vllm_importable()):
        gpus = connect_ray() if connect_ray is not None else cluster_gpus()
    if choose_engine_name(settings.engine, gpus=gpus) == "vllm":
        from video_assets.core.structuring.engines import VllmStructurer

        return VllmStructurer(settings.vllm_settings(model), files if settings.model == CAPTIONER else None)
    if warm is not None and settings.model == CAPTIONER:
        from video_assets.core.captioning.job import WarmStructurer

        return WarmStructurer(warm, settings.batch_size)
    from video_assets.core.structuring.engines import TransformersStructurer

    return TransformersStructurer(model, settings.device, settings.batch_size)


def structure_rows(
    engine, settings: StructurerSettings, uc: uc_mod.UseCase, caption_rows: list[dict], structurer: str, log=None
) -> list[dict]:
    """structured_events rows for caption rows (dicts of the captions table), one per caption."""
    now = datetime.now(UTC)
    results = structure_captions(engine, uc, caption_rows, settings.max_new_tokens, settings.retry_max_new_tokens)
    out = []
    for n, (c, r) in enumerate(zip(caption_rows, results), start=1):
        if log is not None:
            name = c["uri"].rsplit("/", 1)[-1]
            log.info(
                f"[{n}/{len(caption_rows)}] {uc.name} {name} segment {c['segment']}: {r['status']}"
                + (f" {r['verdict']}" if r["verdict"] else "")
                + (f" ({r['error']})" if r["error"] else "")
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
                **r,
                "n_events": len(r["events"]),
                "structured_at": now,
            }
        )
    return out


def answered_events(tables: DeltaTables, batch: str, model_version: str, prompt_version: int) -> pl.DataFrame:
    """The batch's answered structured rows of one caption pair, the latest per (video, segment, use case):
    a newer use-case version or structurer wins. What summaries and the search index read."""
    rows = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        caption_versions(model_version, prompt_version) & pl.col("status").is_in(list(ANSWERED))
    )
    if rows.is_empty():
        return rows
    return rows.sort("structured_at").unique(["video_id", "segment", "use_case"], keep="last", maintain_order=True)


def use_case_version(
    model_version: str, prompt_version: int, structurer: str, use_cases: list[uc_mod.UseCase], extra: str = ""
) -> DataVersion:
    """What a batch's structured rows derive from: the caption pair, the structurer, each use case's version."""
    ucs = ",".join(f"{u.name}:{u.version}" for u in use_cases)
    return DataVersion(f"model-v{model_version}-prompt-v{prompt_version}-{structurer}-{ucs}{extra}")
