"""The video volume: a local folder by default, any pyarrow filesystem URI (s3://, gs://, ...) otherwise."""

from __future__ import annotations

from typing import IO

import pyarrow.fs as pafs
from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.media.source import is_remote, resolve
from video_assets.core.uploads.discovery import VolumeFile, sha256_stream

VIDEO_SUFFIXES = (
    ".mp4",
    ".m4v",
    ".mov",
    ".mkv",
    ".webm",
    ".avi",
    ".mpg",
    ".mpeg",
    ".ts",
    ".mts",
    ".m2ts",
    ".flv",
    ".wmv",
    ".3gp",
    ".ogv",
    ".mxf",
)


class VideoVolume(ConfigurableResource):
    """Where uploads land. Only this class knows how to list and open them."""

    uri: str = Field(description="Folder or bucket URI, e.g. /data/videos or s3://bucket/prefix")
    suffixes: list[str] = Field(default=list(VIDEO_SUFFIXES), description="File suffixes treated as videos")
    include_all_files: bool = Field(
        default=False,
        description="List every file, not only known video suffixes (odd files then get ok=false rows).",
    )
    batch_size: int = Field(default=50, ge=1, description="Most files in one upload batch (partition)")
    max_files_per_call: int = Field(
        default=500, ge=1, description="Most new files hashed per sensor tick; the rest wait for the next tick"
    )

    def _fs(self) -> tuple[pafs.FileSystem, str, bool]:
        if is_remote(self.uri):
            fs, root = pafs.FileSystem.from_uri(self.uri)
            return fs, root, True
        local = self.uri.removeprefix("file://")
        return pafs.LocalFileSystem(), str(pafs.LocalFileSystem().normalize_path(local)), False

    def _to_uri(self, path: str, remote: bool) -> str:
        if not remote:
            return path
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://{path}"

    def list_files(self) -> list[VolumeFile]:
        fs, root, remote = self._fs()
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"video volume {self.uri!r} does not exist")
        selector = pafs.FileSelector(root, recursive=True)
        wanted = tuple(s.lower() for s in self.suffixes)
        out = []
        for entry in fs.get_file_info(selector):
            if entry.type != pafs.FileType.File:
                continue
            name = entry.base_name
            if name.startswith("."):  # hidden files and partial uploads (.part, .tmp...)
                continue
            if not self.include_all_files and not name.lower().endswith(wanted):
                continue
            mtime = entry.mtime.timestamp() if entry.mtime is not None else 0.0
            out.append(VolumeFile(self._to_uri(entry.path, remote), int(entry.size or 0), mtime))
        return sorted(out, key=lambda f: f.uri)

    def stat(self, uri: str) -> VolumeFile | None:
        fs, path = self._resolve(uri)
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            return None
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        return VolumeFile(uri, int(info.size or 0), mtime)

    def _resolve(self, uri: str) -> tuple[pafs.FileSystem, str]:
        return resolve(uri)

    def open(self, uri: str) -> IO[bytes]:
        """A seekable binary stream (PyAV reads remote objects through it without a local copy)."""
        fs, path = self._resolve(uri)
        return fs.open_input_file(path)

    def content_hash(self, uri: str) -> str:
        with self.open(uri) as stream:
            return sha256_stream(stream)
