"""Versions carried by lineage, and the reads several stages share.

The production alias is resolved once, where captions are made (`engines.resolve_caption_model`); the
captions step records the model and prompt versions it used in its materialisation. Every stage
downstream takes the versions from what its upstream materialised for the same batch (and records
them in turn), never from a fresh alias lookup: if `production` moves between two steps of one run,
the later steps still work on the captions the earlier ones wrote."""

from dataclasses import dataclass

import polars as pl
from dagster import AssetKey, AssetRecordsFilter, DataVersion, Failure, MetadataValue

from resources.delta import DeltaTables
from resources.structurer import CAPTIONER, StructurerSettings
from video_assets.core.captioning.versions import caption_versions
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.tables import CAPTIONS, GOLDEN_SET, SAMPLED_FRAMES, SCHEMAS, STRUCTURED_EVENTS
from video_assets.core.vocabulary import ANSWERED


@dataclass(frozen=True)
class CaptionPair:
    """The (model version, prompt version) a batch's captions were made with."""

    model_version: str
    prompt_version: int

    def metadata(self) -> dict:
        """What a materialisation records, so the next stage can read it back (`upstream_pair`)."""
        return {
            "model_version": MetadataValue.text(self.model_version),
            "prompt_version": MetadataValue.int(self.prompt_version),
        }

    def __str__(self) -> str:
        return f"model v{self.model_version}, prompt v{self.prompt_version}"


def upstream_metadata(context, asset: str, batch: str | None = None) -> dict | None:
    """Metadata values of ``asset``'s latest materialisation (of partition ``batch``), or None."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[batch] if batch is not None else None),
        limit=1,
        ascending=False,
    ).records
    if not records or records[0].asset_materialization is None:
        return None
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def upstream_pair(context, batch: str | None, asset: str = CAPTIONS) -> CaptionPair:
    """The caption pair ``asset`` last materialised for ``batch`` (the whole asset when None); a Failure
    that says what to run when it has not been materialised with one."""
    meta = upstream_metadata(context, asset, batch)
    if not meta or meta.get("model_version") is None or meta.get("prompt_version") is None:
        where = f" for batch {batch!r}" if batch is not None else ""
        raise Failure(f"{asset} has not been materialised{where}: materialise it first", allow_retries=False)
    return CaptionPair(str(meta["model_version"]), int(meta["prompt_version"]))


def upstream_value(context, asset: str, batch: str | None, key: str):
    """One metadata value of ``asset``'s latest materialisation of ``batch`` (None when absent)."""
    return (upstream_metadata(context, asset, batch) or {}).get(key)


def batch_captions(tables: DeltaTables, batch: str, pair: CaptionPair) -> pl.DataFrame:
    """The batch's captions by one (model, prompt) pair."""
    return tables.batch(CAPTIONS, batch, SCHEMAS[CAPTIONS]).filter(
        caption_versions(pair.model_version, pair.prompt_version)
    )


def lineage_captions(context, tables: DeltaTables, batch: str) -> tuple[pl.DataFrame, CaptionPair]:
    """The batch's captions of the pair the captions step last wrote for it, with that pair; a Failure
    that says what to run when there are none (the stages that read captions start here)."""
    pair = upstream_pair(context, batch)
    caps = batch_captions(tables, batch, pair)
    if caps.is_empty():
        raise Failure(f"captions has no rows for batch {batch!r} ({pair}): materialise it first")
    return caps, pair


def with_sampled_frames(tables: DeltaTables, batch: str, pair: CaptionPair, videos: list[dict]) -> dict:
    """Adds to each of ``videos`` (a later stage's input rows: one per video) the JPEGs its captions of
    ``pair`` were made from (``stored_times``, ``stored_images``: the captions step's sampled_frames), so its
    CPU stage takes those instead of decoding the video again (``frames.caption_frames_at``). Returns how
    many videos got them and how many will be decoded again (captions older than the table)."""
    wanted = {v["video_id"] for v in videos}
    rows = tables.batch(SAMPLED_FRAMES, batch, SCHEMAS[SAMPLED_FRAMES]).filter(
        caption_versions(pair.model_version, pair.prompt_version) & pl.col("video_id").is_in(list(wanted))
    )
    stored = {
        vid: (df.get_column("timestamp_s").to_list(), df.get_column("image").to_list())
        for (vid,), df in rows.sort("video_id", "segment", "frame").group_by(["video_id"], maintain_order=True)
    }
    for video in videos:
        times, images = stored.get(video["video_id"], ([], []))
        video |= {"stored_times": times, "stored_images": images}
    return {"sampled_frames": sum(v["video_id"] in stored for v in videos), "decoded_again": len(wanted - set(stored))}


def answered_events(tables: DeltaTables, batch: str, pair: CaptionPair) -> pl.DataFrame:
    """The batch's answered structured rows of one caption pair, the latest per (video, segment, use case):
    a newer use-case version or structurer wins. What summaries and the search index read."""
    rows = tables.batch(STRUCTURED_EVENTS, batch, SCHEMAS[STRUCTURED_EVENTS]).filter(
        caption_versions(pair.model_version, pair.prompt_version) & pl.col("status").is_in(list(ANSWERED))
    )
    if rows.is_empty():
        return rows
    return rows.sort("structured_at").unique(["video_id", "segment", "use_case"], keep="last", maintain_order=True)


def use_case_version(
    pair: CaptionPair, structurer: str, use_cases: list[uc_mod.UseCase], extra: str = ""
) -> DataVersion:
    """What a batch's structured rows derive from: the caption pair, the structurer, each use case's version."""
    ucs = ",".join(f"{u.name}:{u.version}" for u in use_cases)
    return DataVersion(f"model-v{pair.model_version}-prompt-v{pair.prompt_version}-{structurer}-{ucs}{extra}")


def golden_rows(tables: DeltaTables, use_case: str) -> list[dict]:
    return tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET]).filter(pl.col("use_case") == use_case).to_dicts()


def structurer_id(settings: StructurerSettings, model_name: str, model_version: str) -> str:
    """What structured rows name as their structurer: the caption model's version when it structures, else the
    structuring model."""
    return f"{model_name}/v{model_version}" if settings.model == CAPTIONER else settings.model
