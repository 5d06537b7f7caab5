"""Search stage asset: a batch's transcript segments, captions, frames, events (and summaries, when the
``video_summaries`` table exists) written to the LanceDB index, under the versions lineage names.

Per batch and idempotent: the batch's rows of each index table are deleted and added again, so a second
materialisation leaves the same rows, and a new encoder or caption version replaces the batch's rows.
"""

import time

import polars as pl
from dagster import AssetExecutionContext, MaterializeResult, MetadataValue

from resources.archive import TEXT, ArchiveSettings
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.search import SearchIndex
from video_assets.core.captioning.versions import caption_source_version
from video_assets.core.search import index as ix
from video_assets.core.tables import (
    FRAME_EMBEDDINGS,
    SCHEMAS,
    TEXT_EMBEDDINGS,
    TRANSCRIPTS,
    VIDEO_SUMMARIES,
)
from video_assets.core.vocabulary import SOURCE_CAPTION, SOURCE_TRANSCRIPT
from video_assets.defs.common import TRANSIENT_RETRY, batch_asset
from video_assets.defs.lineage import answered_events, upstream_pair, upstream_value
from video_assets.defs.registry import archive_model_files


@batch_asset(
    "search",
    kinds=("lancedb",),
    deps=[
        "transcripts",
        "captions",
        "text_embeddings",
        "frame_embeddings",
        "structured_events",
        "video_summaries",
    ],
    retry_policy=TRANSIENT_RETRY,
)
def search_index(
    context: AssetExecutionContext,
    batch: str,
    archive: ArchiveSettings,
    mlflow_registry: MlflowRegistry,
    tables: DeltaTables,
    search_index_store: SearchIndex,
) -> MaterializeResult:
    """The batch's rows of the search index (LanceDB: tables texts, frames, events, summaries), from the
    rows its upstream steps last wrote for the batch: each version (encoders, speech model, caption
    pair) is the one the upstream materialisation recorded. Event and summary texts are embedded here
    with the text encoder version the text embeddings were made with."""
    started = time.perf_counter()
    text_version = upstream_value(context, TEXT_EMBEDDINGS, batch, "encoder_version")
    frame_version = upstream_value(context, FRAME_EMBEDDINGS, batch, "encoder_version")
    speech_version = upstream_value(context, TRANSCRIPTS, batch, "model_version")
    pair = upstream_pair(context, batch)  # the captions' pair: their texts and their events are indexed
    caption_version = caption_source_version(pair.model_version, pair.prompt_version)

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
    events = answered_events(tables, batch, pair)
    has_summaries = tables.exists(VIDEO_SUMMARIES)
    summaries = tables.batch(VIDEO_SUMMARIES, batch, SCHEMAS[VIDEO_SUMMARIES]) if has_summaries else None

    encode = None
    if events.get_column("n_events").sum() or (summaries is not None and not summaries.is_empty()):
        from video_assets.core.embeddings.text import TextEncoder

        model, _ = archive_model_files(mlflow_registry, archive, TEXT, text_version)
        encode = TextEncoder(model.here()).encode  # the step fetched its small files: here() adds the weights
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
            **pair.metadata(),
            "write_s": MetadataValue.float(written["write_s"]),
            "fts_s": MetadataValue.float(written["fts_s"]),
            "seconds": MetadataValue.float(round(time.perf_counter() - started, 3)),
        }
    )
