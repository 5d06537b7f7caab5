"""Where the search index (LanceDB) lives: the one place that knows it."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class SearchIndex(ConfigurableResource):
    """The LanceDB database the ``search_index`` asset writes and the service reads (a folder, or an
    object-store URI LanceDB supports)."""

    uri: str = Field(description="LanceDB database URI (VIDEO_INDEX_URI; default <tables root>/../search_index)")

    def exists(self) -> bool:
        from video_assets.core.search.index import index_exists

        return index_exists(self.uri)
