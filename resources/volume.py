"""The video volume: a local folder by default, any pyarrow filesystem URI (s3://, gs://, ...) otherwise."""

from __future__ import annotations

import functools
import os
import stat as stat_mod
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import pyarrow.fs as pafs
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field

from video_assets.core.media.source import is_remote, resolve
from video_assets.core.uploads.discovery import Listing, Refused, VolumeFile, sha256_stream

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
    full_listing_s: float = Field(
        default=3600.0,
        ge=0,
        description="A local volume's sensor ticks list only the folders that changed since the last tick; every "
        "this many seconds a tick lists everything (a file rewritten in place changes no folder). 0: every tick",
    )

    def setup_for_execution(self, context: InitResourceContext) -> None:
        # Before the step or sensor tick does any work: a missing volume is named as such, not
        # reported as every file "missing".
        self.check_reachable()

    def stream_folder(self, camera: str) -> Path:
        """Where the recorder writes a camera's segments: ``streams/<camera>`` in a local volume (a recorder
        writing to an object store is not built: a ValueError naming VIDEO_VOLUME_URI)."""
        if is_remote(self.uri):
            raise ValueError(f"VIDEO_VOLUME_URI={self.uri}: the recorder writes to a local volume only")
        return Path(self.uri.removeprefix("file://")) / "streams" / camera

    def check_reachable(self) -> None:
        """A local volume must be a readable folder; raises ``VolumeUnavailable`` naming
        VIDEO_VOLUME_URI otherwise. Object-store volumes are checked by their first listing."""
        if is_remote(self.uri):
            return
        root = self.uri.removeprefix("file://")
        try:
            with os.scandir(root) as entries:
                next(entries, None)
        except OSError as exc:
            what = "does not exist" if isinstance(exc, FileNotFoundError) else "is not a readable folder"
            raise VolumeUnavailable(
                f"the video volume {root} {what} ({exc.__class__.__name__}: {exc.strerror or exc}); "
                "set VIDEO_VOLUME_URI to the folder or bucket of uploads"
            ) from exc

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
        return self.listing().files

    def listing(self) -> Listing:
        """The files to register, and the entries refused with the reason (links, special files).

        A local volume is walked without following links, so nothing outside its root is listed,
        hashed or opened, and a link loop cannot repeat a file (pyarrow's recursive listing follows them).
        """
        fs, root, remote = self._fs()
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"video volume {self.uri!r} does not exist (VIDEO_VOLUME_URI)")
        if not remote:
            return self._walk_local(root)
        selector = pafs.FileSelector(root, recursive=True)
        out = []
        for entry in fs.get_file_info(selector):
            if entry.type != pafs.FileType.File or not self._wanted(entry.base_name):
                continue
            mtime = entry.mtime.timestamp() if entry.mtime is not None else 0.0
            out.append(VolumeFile(self._to_uri(entry.path, remote), int(entry.size or 0), mtime))
        return Listing(sorted(out, key=lambda f: f.uri), [])

    def is_stream(self, uri: str) -> bool:
        """Whether ``uri`` is a camera's segment: under ``streams/`` at the volume's root (the recorder's)."""
        root = self.uri.removeprefix("file://").rstrip("/") + "/"
        return uri.removeprefix("file://").startswith(root + "streams/")

    def _wanted(self, name: str) -> bool:
        if name.startswith("."):  # hidden files and partial uploads (.part, .tmp...)
            return False
        return self.include_all_files or name.lower().endswith(_lowered(tuple(self.suffixes)))

    def _walk_local(self, root: str) -> Listing:
        return self._walk(root, None, skip=None).listing

    def local_root(self) -> str:
        """A local volume's root folder as its listings name it (normalised)."""
        return self._fs()[1]

    def changed_listing(self, folders: dict | None, streams: bool) -> Walk:
        """The files of a local volume's folders that changed since ``folders`` (the ``Walk.folders`` an earlier
        call returned; None: every folder), under ``streams/`` (``streams``) or everywhere else. A folder's mtime
        moves when an entry is added, removed or renamed in it, so an unchanged folder is not listed: its
        subfolders are taken from ``folders`` and only stat'ed. A tick then costs a stat per folder plus the
        changed folders' entries, not the archive. A file rewritten in place moves no folder: a full listing
        (``folders`` None, every ``full_listing_s``) finds it."""
        _, root, remote = self._fs()
        if remote:
            raise ValueError("changed_listing lists a local volume; a bucket is listed whole")
        top = os.path.join(root, "streams") if streams else root
        if streams and not os.path.isdir(top):
            return Walk(Listing([], []), {}, [])
        return self._walk(top, folders, skip=None if streams else os.path.join(root, "streams"))

    def _walk(self, top: str, known: dict | None, skip: str | None) -> Walk:
        files: list[VolumeFile] = []
        refused: list[Refused] = []
        folders: dict[str, list] = {}  # folder -> [mtime_ns, subfolders]: the next call's ``known``
        changed: list[str] = []
        pending = [top]
        while pending:
            folder = pending.pop()
            try:
                mtime_ns = os.stat(folder, follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:  # removed since its parent was listed
                continue
            except OSError as exc:
                refused.append(Refused(folder, f"folder not readable: {exc.strerror or exc}"))
                continue
            before = (known or {}).get(folder)
            if before is not None and before[0] == mtime_ns:  # nothing added, removed or renamed here
                folders[folder] = before
                pending.extend(before[1])
                continue
            try:
                entries = list(os.scandir(folder))
            except OSError as exc:  # unreadable subfolder: say so, keep listing the rest
                refused.append(Refused(folder, f"folder not readable: {exc.strerror or exc}"))
                continue
            changed.append(folder)
            subfolders = []
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_symlink():
                    refused.append(Refused(entry.path, _link_reason(entry.path)))
                elif entry.is_dir(follow_symlinks=False):
                    if entry.path != skip:
                        subfolders.append(entry.path)
                elif not self._wanted(entry.name):
                    continue
                elif not _utf8(entry.path):  # the tables store names as UTF-8 text
                    refused.append(Refused(entry.path, "name is not valid UTF-8: not registered"))
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    files.append(VolumeFile(entry.path, st.st_size, _mtime(st.st_mtime_ns)))
                else:  # a FIFO would block the hasher forever; devices and sockets are not uploads
                    refused.append(Refused(entry.path, "not a regular file (fifo, socket or device): not read"))
            folders[folder] = [mtime_ns, sorted(subfolders)]
            pending.extend(subfolders)
        listing = Listing(sorted(files, key=lambda f: f.uri), sorted(refused, key=lambda r: r.uri))
        return Walk(listing, folders, sorted(changed))

    def refusal(self, uri: str) -> str | None:
        """Why ``uri`` must not be read (outside the root, or reached through a link), or None.

        Checked again on every open: a file may be swapped for a link after it was listed."""
        if is_remote(self.uri):
            return None  # object stores have no links; the URI names the object
        _, root, _ = self._fs()
        path = os.path.abspath(uri.removeprefix("file://"))
        if os.path.commonpath([root, path]) != root:
            return f"outside the volume {root}: not read"
        real_root = os.path.realpath(root)
        expected = os.path.join(real_root, os.path.relpath(path, root))
        if os.path.realpath(path) != expected:
            return _link_reason(path) if os.path.islink(path) else "reached through a symbolic link: not read"
        return None

    def _checked(self, uri: str) -> None:
        reason = self.refusal(uri)
        if reason is not None:
            raise RefusedPath(reason)

    def stat(self, uri: str) -> VolumeFile | None:
        """The file's size and mtime; None when it is gone. Raises ``RefusedPath`` for a link."""
        self._checked(uri)
        fs, path = self._resolve(uri)
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            return None
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        return VolumeFile(uri, int(info.size or 0), mtime)

    def delete(self, uri: str) -> bool:
        """Remove a file of the volume (retention of stream segments); False when it was already gone.
        Refuses what ``refusal`` refuses: nothing outside the volume, nothing through a link."""
        self._checked(uri)
        fs, path = self._resolve(uri)
        if fs.get_file_info(path).type != pafs.FileType.File:
            return False
        fs.delete_file(path)
        return True

    def _resolve(self, uri: str) -> tuple[pafs.FileSystem, str]:
        return resolve(uri)

    def open(self, uri: str) -> IO[bytes]:
        """A seekable binary stream (PyAV reads remote objects through it without a local copy).

        A local file is opened without following a final link (O_NOFOLLOW) and must be a regular
        file, which closes the gap between the check and the open."""
        self._checked(uri)
        if is_remote(uri):
            fs, path = self._resolve(uri)
            return fs.open_input_file(path)
        path = uri.removeprefix("file://")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RefusedPath("not a regular file: not read")
        return os.fdopen(fd, "rb")

    def content_hash(self, uri: str) -> str:
        with self.open(uri) as stream:
            return sha256_stream(stream)


class VolumeUnavailable(RuntimeError):
    """The volume cannot be listed; the message names the setting to fix."""


class RefusedPath(PermissionError):
    """A path this volume must not read: outside its root, a link, or not a regular file."""


@dataclass
class Walk:
    """A local walk: the files and refused entries of the folders it listed, every folder's mtime and subfolders
    (``[mtime_ns, [subfolder, ...]]``, for the next walk) and the folders it listed (changed)."""

    listing: Listing
    folders: dict[str, list] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)


@functools.cache
def _lowered(suffixes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s.lower() for s in suffixes)  # once, not per file: a 20,000-file listing spent 0.3 s here


def _mtime(ns: int) -> float:
    """Seconds as pyarrow's listing (used before) reports them, to the microsecond: the manifest's
    fingerprints were made that way, and any other rounding makes a known file look new."""
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).timestamp()


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes arrive as lone surrogates (surrogateescape)
        return False
    return True


def _link_reason(path: str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return f"symbolic link to {target}: links are not followed"
