"""Search: the LanceDB index over transcripts, captions, frames, events and summaries, per batch."""

from dagster import Definitions

from video_assets.defs.search.assets import search_index

defs = Definitions(assets=[search_index])
