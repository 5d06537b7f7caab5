"""How a video URI is opened for PyAV: a local path as is, an object-store URI as a seekable stream.

The URI comes from the volume listing (``resources.volume``); this module only turns it into
something FFmpeg can read, wherever the code runs (the Dagster step or a Ray worker).
"""

from __future__ import annotations

from typing import IO

import pyarrow.fs as pafs


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``uri`` and the path within it."""
    if is_remote(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), uri.removeprefix("file://")


def open_media(uri: str) -> str | IO[bytes]:
    """What PyAV should open: a local path (FFmpeg does its own I/O) or a seekable remote stream."""
    if not is_remote(uri):
        return uri.removeprefix("file://")
    fs, path = resolve(uri)
    return fs.open_input_file(path)
