"""Search stage asset: a batch's transcript segments, captions, frames, events (and summaries, when the
``video_summaries`` table exists) written to the LanceDB index, under the versions behind the aliases.

Per batch and idempotent: the batch's rows of each index table are deleted and added again, so a second
materialisation leaves the same rows, and a new encoder or caption version replaces the batch's rows.
"""

import time

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from resources.archive import FRAMES, SPEECH, TEXT, ArchiveSettings
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.search import SearchIndex
from resources.vlm import VlmSettings
from video_assets.core.captioning.versions import caption_source_version
from video_assets.core.search import index as ix
from video_assets.core.tables import (
    FRAME_EMBEDDINGS,
    SCHEMAS,
    TEXT_EMBEDDINGS,
    VIDEO_SUMMARIES,
)
from video_assets.core.vocabulary import SOURCE_CAPTION, SOURCE_TRANSCRIPT
from video_assets.defs.captioning.assets import captions
from video_assets.defs.common import SINGLE_RUN, TRANSIENT_RETRY, per_batch, stage_asset
from video_assets.defs.embeddings.assets import frame_embeddings, text_embeddings
from video_assets.defs.models.assets import archive_model_files, archive_version, production_versions
from video_assets.defs.partitions import video_batches
from video_assets.defs.structuring.assets import structured_events
from video_assets.defs.structuring.runner import answered_events
from video_assets.defs.transcripts.assets import transcripts

try:  # summaries are another stage's, built separately: indexed when that asset exists
    from video_assets.defs.summaries.assets import video_summaries

    _SUMMARY_DEPS = [video_summaries]
except ImportError:
    _SUMMARY_DEPS = []


@asset(
    partitions_def=video_batches,
    backfill_policy=SINGLE_RUN,
    deps=[transcripts, captions, text_embeddings, frame_embeddings, structured_events, *_SUMMARY_DEPS],
    retry_policy=TRANSIENT_RETRY,
    **stage_asset("search", kinds=("lancedb",)),
)
def search_index(
    context: AssetExecutionContext,
    archive: ArchiveSettings,
    vlm: VlmSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    search_index_store: SearchIndex,
) -> MaterializeResult:
    """The batch's rows of the search index (LanceDB: tables texts, frames, events, summaries), from the
    rows of the versions behind the aliases: text and frame encoders, speech model, captioning model and
    prompt. Event and summary texts are embedded here with the text encoder behind the alias."""
    [result] = per_batch(
        context,
        lambda batch: _search_index_batch(batch, context, archive, vlm, mlflow_registry, tables, search_index_store),
    )
    return result


def _search_index_batch(
    batch: str,
    context: AssetExecutionContext,
    archive: ArchiveSettings,
    vlm: VlmSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    search_index_store: SearchIndex,
) -> MaterializeResult:
    started = time.perf_counter()
    text_version = archive_version(mlflow_registry, archive, TEXT)
    frame_version = archive_version(mlflow_registry, archive, FRAMES)
    speech_version = archive_version(mlflow_registry, archive, SPEECH)
    caption_model, caption_prompt = production_versions(vlm, mlflow_registry)
    caption_version = caption_source_version(caption_model, caption_prompt)

    texts = tables.batch(TEXT_EMBEDDINGS, batch, SCHEMAS[TEXT_EMBEDDINGS]).filter(
        (pl.col("encoder_version") == text_version)
        & (
            ((pl.col("source") == SOURCE_TRANSCRIPT) & (pl.col("source_version") == speech_version))
            | ((pl.col("source") == SOURCE_CAPTION) & (pl.col("source_version") == caption_version))
        )
    )
    frames = tables.batch(FRAME_EMBEDDINGS, batch, SCHEMAS[FRAME_EMBEDDINGS]).filter(
        pl.col("encoder_version") == frame_version
    )
    events = answered_events(tables, batch, caption_model, caption_prompt)
    has_summaries = tables.exists(VIDEO_SUMMARIES)
    summaries = tables.batch(VIDEO_SUMMARIES, batch, SCHEMAS[VIDEO_SUMMARIES]) if has_summaries else None

    encode = None
    if events.get_column("n_events").sum() or (summaries is not None and not summaries.is_empty()):
        from video_assets.core.embeddings.text import TextEncoder

        model, _ = archive_model_files(mlflow_registry, archive, TEXT)
        encode = TextEncoder(model.path).encode
    rows = {
        ix.TEXTS: ix.text_rows(texts),
        ix.FRAMES: ix.frame_rows(frames),
        ix.EVENTS: ix.event_rows(events, encode, text_version) if encode else None,
    }
    if summaries is not None:
        rows[ix.SUMMARIES] = ix.summary_rows(summaries, encode, text_version) if encode else None
    written = ix.write_batch(search_index_store.uri, batch, rows)
    totals = ix.table_counts(search_index_store.uri)
    context.log.info(f"batch {batch}: index rows {written['rows']} at {search_index_store.uri}")
    return MaterializeResult(
        metadata={
            "dagster/uri": MetadataValue.path(search_index_store.uri),
            "dagster/row_count": MetadataValue.int(sum(written["rows"].values())),
            "batch_rows": MetadataValue.json(written["rows"]),
            "table_rows": MetadataValue.json(totals),
            "total_rows": MetadataValue.int(sum(totals.values())),
            "summaries_indexed": MetadataValue.bool(has_summaries),
            "text_encoder_version": MetadataValue.text(str(text_version)),
            "frame_encoder_version": MetadataValue.text(str(frame_version)),
            "write_s": MetadataValue.float(written["write_s"]),
            "fts_s": MetadataValue.float(written["fts_s"]),
            "seconds": MetadataValue.float(round(time.perf_counter() - started, 3)),
        }
    )
