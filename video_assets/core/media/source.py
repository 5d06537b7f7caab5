"""How a video URI is opened for PyAV, wherever the code runs (the Dagster step or a Ray worker):
a local path as is; an object-store URI (``s3://``, ``gs://``, …) as a seekable pyarrow stream, so
FFmpeg's seeks become ranged reads; an ``http(s)://`` URL handed to FFmpeg, which reads it with range
requests itself. The URI comes from the volume listing (``resources.volume``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import av
import pyarrow.fs as pafs

FFMPEG_SCHEMES = ("http://", "https://")  # FFmpeg's own protocols: ranged reads without pyarrow


class MediaOpenError(Exception):
    """A source that cannot be opened as a media container, with a readable reason."""


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem holding ``uri`` and the path within it."""
    if is_remote(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), uri.removeprefix("file://")


def open_media(uri: str) -> str | IO[bytes]:
    """What PyAV should open: a local path (FFmpeg does its own I/O) or a seekable remote stream.

    A local path that is a symbolic link is refused (``PermissionError``): the volume lists no
    links, so one here was swapped in after listing and may point outside the volume."""
    if not is_remote(uri):
        path = uri.removeprefix("file://")
        if os.path.islink(path):
            raise PermissionError(f"symbolic link, not opened: {path}")
        return path
    if uri.startswith(FFMPEG_SCHEMES):
        return uri
    fs, path = resolve(uri)
    return fs.open_input_file(path)


@contextmanager
def open_container(uri: str, error: type[Exception] = MediaOpenError) -> Iterator[av.container.InputContainer]:
    """The PyAV container of ``uri``; the container and any stream under it are closed on exit. A
    source that does not open raises ``error`` with the reason."""
    try:
        target = open_media(uri)
    except OSError as exc:  # missing object, no permission, unreachable endpoint
        raise error(f"cannot open as a media container: {exc.__class__.__name__}: {exc}") from exc
    try:
        try:
            container = av.open(target, mode="r", metadata_errors="ignore")
        except (av.error.FFmpegError, OSError, ValueError) as exc:
            detail = str(exc).strip() or "no detail"
            raise error(f"cannot open as a media container: {exc.__class__.__name__}: {detail}") from exc
        with container:
            yield container
    finally:
        if not isinstance(target, str):
            target.close()
