"""Where frame curation writes files: the JPEGs of kept frames (``image_store: files``) and the training
exports. The frames table itself is a Delta table like every other (``DeltaTables``)."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field


class CurationStore(ConfigurableResource):
    frames_dir: str = Field(description="Folder of kept-frame JPEGs when a frames run stores images as files")
    exports_dir: str = Field(description="Folder of training exports (one sub-folder per export)")

    def frame_path(self, curation_version: str, video_id: str, segment: int, frame: int) -> Path:
        return Path(self.frames_dir) / curation_version / video_id / f"{segment:04d}_{frame:04d}.jpg"

    def export_path(self, name: str) -> Path:
        return Path(self.exports_dir) / name
