"""Embeddings: a vector per caption frame, and per transcript segment and caption, one Ray Data job each
per batch."""

from dagster import Definitions

from video_assets.defs.embeddings.assets import frame_embeddings, text_embeddings
from video_assets.defs.embeddings.checks import embedding_checks

defs = Definitions(assets=[frame_embeddings, text_embeddings], asset_checks=embedding_checks)
