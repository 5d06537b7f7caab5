"""Summaries stage asset: one summary per video of a batch, from its captions (production model and
prompt), its transcript (speech model behind the alias) and its parsed events, merged in time order into
``[mm:ss]`` lines. Extractive without an LLM; map-reduce by the OpenAI-compatible LLM (``LLM_BASE_URL``)
with one, or by the caption model itself (``LLM_BASE_URL=captioner``: the version that made the captions,
on its served application). Idempotent: a video whose input rows (and summarizer) are unchanged is not summarised again."""

import hashlib
from datetime import UTC, datetime

import polars as pl
from dagster import AssetExecutionContext, Config, DataVersion, Failure, MaterializeResult, MetadataValue
from dagster_ray import RayResource
from pydantic import Field

from resources.delta import DeltaTables
from resources.llm import LlmSettings
from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from video_assets.core.qa import summaries as summ
from video_assets.core.qa.llm import LlmUnavailable
from video_assets.core.tables import SCHEMAS, STRUCTURED_EVENTS, TRANSCRIPTS, VIDEO_SUMMARIES, to_arrow
from video_assets.core.uploads.discovery import printable
from video_assets.defs.common import batch_asset, table_metadata
from video_assets.defs.engines import caption_model_chat
from video_assets.defs.lineage import (
    answered_events,
    lineage_captions,
    upstream_metadata,
    upstream_pair,
    upstream_value,
)
from video_assets.defs.ray_session import connect_ray

EXTRACTIVE = "extractive"


class SummariesConfig(Config):
    max_lines: int = Field(default=12, ge=1, description="Extractive: lines kept (events always are)")
    chunk_chars: int = Field(default=6000, ge=200, description="LLM: timeline characters per map step")
    resummarize: bool = Field(default=False, description="Summarise again videos whose inputs did not change")


@batch_asset("summaries", VIDEO_SUMMARIES, kinds=("mlflow",), deps=["captions", "transcripts", "structured_events"])
def video_summaries(
    context: AssetExecutionContext,
    batch: str,
    config: SummariesConfig,
    llm: LlmSettings,
    tables: DeltaTables,
    vlm: VlmSettings,
    mlflow_registry: MlflowRegistry,
    ray_on_demand: RayResource,
) -> MaterializeResult:
    """What happens in each video of the batch, with ``[mm:ss]`` times: every event, and captions and
    speech spread over the video (extractive), or an LLM's map-reduce summary of the whole timeline.
    Captions, transcripts and events are those the upstream steps last wrote for the batch (lineage)."""
    caps, pair = lineage_captions(context, tables, batch)
    speech_version = upstream_value(context, TRANSCRIPTS, batch, "model_version")
    if speech_version is None:
        context.log.warning(f"transcripts not materialised for batch {batch!r}: summaries without transcripts")
        said = pl.DataFrame(schema=pl.from_arrow(SCHEMAS[TRANSCRIPTS].empty_table()).schema)
    else:
        said = tables.batch(TRANSCRIPTS, batch, SCHEMAS[TRANSCRIPTS]).filter(pl.col("model_version") == speech_version)
    structured = upstream_metadata(context, STRUCTURED_EVENTS, batch) is not None
    events = answered_events(tables, batch, upstream_pair(context, batch, STRUCTURED_EVENTS) if structured else pair)

    if llm.uses_captioner:  # the model that made these captions, where it is served: loaded once for all stages
        client = caption_model_chat(
            vlm, mlflow_registry, pair.model_version, lambda: connect_ray(context, ray_on_demand)
        )
    else:
        client = llm.client()
    summarizer = EXTRACTIVE
    if client is not None:
        try:
            summarizer = f"llm:{client.check()}"
        except LlmUnavailable as exc:
            raise Failure(str(exc), allow_retries=False) from exc
    method = f"{summarizer}|lines={config.max_lines}" if client is None else f"{summarizer}|chars={config.chunk_chars}"

    existing = tables.batch(VIDEO_SUMMARIES, batch, SCHEMAS[VIDEO_SUMMARIES]).filter(pl.col("summarizer") == summarizer)
    have = dict(existing.select("video_id", "inputs_version").iter_rows())
    rows, unchanged, n_chunks, versions = [], 0, 0, []
    for (vid,), vcaps in caps.sort("segment").group_by(["video_id"], maintain_order=True):
        inputs = (
            vcaps.to_dicts(),
            said.filter(pl.col("video_id") == vid).to_dicts(),
            events.filter(pl.col("video_id") == vid).to_dicts(),
        )
        version = summ.inputs_version(*inputs, method=method)
        versions.append(version)
        if have.get(vid) == version and not config.resummarize:
            unchanged += 1
            continue
        lines = summ.timeline(*inputs)
        first = vcaps.row(0, named=True)
        if client is None:
            text, parts = summ.extractive_summary(lines, config.max_lines), 1 if lines else 0
        else:
            try:
                text, parts = summ.llm_summary(lines, client, config.chunk_chars)
            except LlmUnavailable as exc:
                raise Failure(str(exc), allow_retries=False) from exc
        n_chunks += parts
        rows.append(
            {
                "video_id": vid,
                "batch_key": first["batch_key"],
                "uri": first["uri"],
                "summarizer": summarizer,
                "summary": text,
                "start_s": min((x.start_s for x in lines), default=None),
                "end_s": max((x.end_s for x in lines), default=None),
                "chunks": parts,
                "inputs_version": version,
                "summarized_at": datetime.now(UTC),
            }
        )
        context.log.info(f"{printable(first['uri'].rsplit('/', 1)[-1])}: {len(lines)} lines, {parts} chunk(s)")
    if rows:
        tables.replace_where(
            VIDEO_SUMMARIES,
            to_arrow(VIDEO_SUMMARIES, rows),
            {"batch_key": [batch], "video_id": sorted(r["video_id"] for r in rows), "summarizer": [summarizer]},
        )

    out = tables.batch(VIDEO_SUMMARIES, batch, SCHEMAS[VIDEO_SUMMARIES]).filter(pl.col("summarizer") == summarizer)
    example = rows[0] if rows else (out.row(0, named=True) if out.height else None)
    return MaterializeResult(
        data_version=DataVersion(hashlib.sha256("".join(sorted(versions)).encode()).hexdigest()[:16]),
        metadata={
            **table_metadata(
                tables.table_uri(VIDEO_SUMMARIES),
                out,
                tables.row_count(VIDEO_SUMMARIES),
                ["uri", "summarizer", "chunks", "start_s", "end_s", "summary"],
            ),
            **pair.metadata(),
            "summarizer": MetadataValue.text(summarizer),
            "videos_summarized": MetadataValue.int(len(rows)),
            "videos_unchanged": MetadataValue.int(unchanged),
            "chunks": MetadataValue.int(n_chunks),
            "rows_written": MetadataValue.int(len(rows)),
            "example_summary": MetadataValue.md(
                f"**{printable(example['uri'].rsplit('/', 1)[-1])}**\n\n```\n{_printable_lines(example['summary'])}\n```"
                if example
                else "_no summary_"
            ),
        },
    )


def _printable_lines(text: str) -> str:
    return "\n".join(printable(line) for line in text.splitlines())
