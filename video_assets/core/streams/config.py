"""Cameras as configuration: a TOML file of ``[[camera]]`` tables. Pure.

    [[camera]]
    name = "dock-1"                       # letters, digits, - and _: the folder streams/<name>/ in the volume
    url = "rtsp://10.0.0.5:554/stream1"   # rtsp(s)://, http(s)://...m3u8, or a local device / file path
    segment_s = 30                        # cut at the first keyframe at or after this many seconds
    username_env = "DOCK1_USER"           # credentials by environment variable name: never in the file,
    password_env = "DOCK1_PASSWORD"       # never stored, never logged (``redacted``)
    stall_s = 10                          # no packet (or no answer to a connect) for this long: dropped, retried
    allowed_hosts = ["cdn.example"]       # HLS only: hosts (host or host:port) besides the playlist's own that its
                                          # segments and variant playlists may come from
    max_playlist_bytes = 1048576          # HLS only: the playlists held at once, in bytes (the recorder's memory)

A bad entry is an error naming the camera (or its position when it has no usable name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from video_assets.core.config_files import load_entries

SCHEMES = ("rtsp", "rtsps", "http", "https")
HOST = r"^(?:[A-Za-z0-9._-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?$"  # a host or [IPv6], optional :port


class Camera(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    url: str = Field(min_length=1, max_length=2048)
    segment_s: float = Field(default=30.0, ge=1, le=3600)
    username_env: str | None = Field(default=None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    password_env: str | None = Field(default=None, pattern=r"^[A-Z_][A-Z0-9_]*$")
    stall_s: float = Field(default=10.0, gt=0, le=600)
    allowed_hosts: tuple[str, ...] = Field(default=(), max_length=64)
    max_playlist_bytes: int = Field(default=1 << 20, ge=4096, le=16 << 20)

    @field_validator("allowed_hosts")
    @classmethod
    def hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        bad = [h for h in hosts if not re.fullmatch(HOST, h)]
        if bad:
            raise ValueError(f"not a host or host:port: {bad[0][:80]!r}")
        return tuple(h.lower() for h in hosts)

    @field_validator("url")
    @classmethod
    def known_kind(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme in SCHEMES:
            if parts.username or parts.password:
                raise ValueError("credentials belong in username_env / password_env, not in the URL")
            if parts.scheme.startswith("http") and not parts.path.endswith(".m3u8"):
                raise ValueError("an http(s) stream must be an HLS playlist (.m3u8)")
            return url
        if parts.scheme and len(parts.scheme) > 1:  # not a Windows drive letter
            raise ValueError(f"unsupported scheme {parts.scheme!r}: use {', '.join(SCHEMES)} or a local path")
        return url

    def open_url(self, env: Mapping[str, str]) -> str:
        """The URL with the credentials from ``env`` (the recorder's environment, ``resources.settings``; for
        the demuxer only: never log it)."""
        user = env.get(self.username_env, "") if self.username_env else ""
        password = env.get(self.password_env, "") if self.password_env else ""
        if not (user or password) or urlsplit(self.url).scheme not in SCHEMES:
            return self.url
        p = urlsplit(self.url)
        auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
        return urlunsplit((p.scheme, f"{auth}@{p.netloc}", p.path, p.query, p.fragment))

    @property
    def redacted(self) -> str:
        """The URL as logs and tables show it: no credentials, no query string (tokens live there)."""
        return redacted(self.url)


def redacted(url: str) -> str:
    p = urlsplit(url)
    if p.scheme not in SCHEMES:
        return url
    host = p.hostname or ""
    netloc = f"{host}:{p.port}" if p.port else host
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


def load_cameras(path: str | Path) -> list[Camera]:
    """The cameras of a config file; ValueError naming the file and the camera for anything wrong."""
    return load_entries(path, "camera", Camera)
