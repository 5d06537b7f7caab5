"""What an HLS camera's playlist may make the recorder fetch, and how much of it. Pure of Dagster.

PyAV's HLS demuxer reads every URL through ``HlsIO`` (its ``io_open``), not through FFmpeg's own http
protocol, so that:

- only http(s) URLs on the playlist's own host and port, or on a host of the camera's ``allowed_hosts``, are
  fetched, redirects included (a playlist cannot send the recorder to ``file:``, ``data:`` or an internal
  service);
- the playlists held at once (the camera's playlist and the latest copy of each variant it names) total at
  most ``max_playlist_bytes``, and each must arrive whole within ``stall_s``: an endless or fast-growing
  playlist is a refusal, never memory (FFmpeg keeps a parsed playlist, about 11x its text, while it plays);
- connecting and every read wait at most ``stall_s`` (a server that accepts and never answers, or a port
  that does not speak HTTP, is a reason, not a hang);
- credentials (``username_env`` / ``password_env``) go to the playlist's own host and port only (Basic auth).

The first refusal or error of a connection is raised to FFmpeg (PyAV raises it again from ``av.open`` or the
next demux call: the connection ends with it as its reason); every later open of that connection reads
nothing, so one error is never reported twice.
"""

from __future__ import annotations

import base64
import time
import urllib.request
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from video_assets.core.streams.config import Camera, redacted

# FFmpeg's own keep-alive and parallel segment requests reuse its http contexts, which custom I/O does not
# have (it asserts on them): every request is a fresh one through HlsIO.
DEMUXER_OPTIONS = {"http_persistent": "0", "http_multiple": "0"}
_PLAYLIST = b"#EXTM3U"  # what FFmpeg's parser requires a playlist to start with


class Refused(Exception):
    """A request the recorder will not make or finish."""


def is_hls(camera: Camera) -> bool:
    return urlsplit(camera.url).scheme in ("http", "https")


def origin(url: str) -> str:
    """``host:port`` of a URL, lower case, the scheme's port when none is given."""
    p = urlsplit(url)
    host = (p.hostname or "").lower()
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{p.port or (443 if p.scheme == 'https' else 80)}"


class _Redirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to where a request may go in the first place."""

    def __init__(self, check):
        self.check = check

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Nothing:
    """What a connection's opens read after its first error."""

    def read(self, n: int) -> bytes:
        return b""

    def close(self) -> None:
        pass


class _Body:
    """One response, read as FFmpeg asks; a playlist (it starts with #EXTM3U) is counted and timed."""

    def __init__(self, io: HlsIO, resp, url: str):
        self.io, self.resp, self.url = io, resp, url
        self.deadline = time.monotonic() + io.camera.stall_s
        self.head, self.kind, self.size, self.done = b"", None, 0, False

    def read(self, n: int) -> bytes:
        if self.done or n <= 0:
            return b""
        try:
            data = self.resp.read1(n)  # what has arrived (at most n): never waits for n bytes
            if self.kind is None:
                self.head = (self.head + data)[:64]
                lead = self.head.lstrip(b"\xef\xbb\xbf \t\r\n")
                if len(lead) >= len(_PLAYLIST) or not data:
                    self.kind = "playlist" if lead.startswith(_PLAYLIST) else "media"
            if self.kind != "media":  # a playlist, or not known yet: counted
                self.size += len(data)
                self.io.held[self.url] = self.size
                if sum(self.io.held.values()) > self.io.camera.max_playlist_bytes:
                    raise Refused(
                        f"playlists larger than max_playlist_bytes={self.io.camera.max_playlist_bytes} "
                        f"({redacted(self.url)})"
                    )
                if data and time.monotonic() > self.deadline:
                    raise Refused(f"a playlist not whole within stall_s={self.io.camera.stall_s:g} s")
            return data
        except Exception as exc:
            self.done = True
            return self.io.failed(exc)

    def close(self) -> None:
        self.resp.close()


class HlsIO:
    """The ``io_open`` of one connection to an HLS camera; ``error``: its first refusal or error."""

    def __init__(self, camera: Camera, env: Mapping[str, str]):
        self.camera, self.home = camera, origin(camera.url)
        self.held: dict[str, int] = {}  # bytes of the latest copy of each playlist
        self.error: Exception | None = None
        user = env.get(camera.username_env, "") if camera.username_env else ""
        password = env.get(camera.password_env, "") if camera.password_env else ""
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.auth = f"Basic {token}" if user or password else None
        self.opener = urllib.request.build_opener(_Redirects(self.check))

    def check(self, url: str) -> None:
        p = urlsplit(url)
        if p.scheme not in ("http", "https"):  # crypto+http (AES-128 segments) too: not supported
            raise Refused(f"a {p.scheme or 'relative'}: URL in the playlist (only http(s) is fetched)")
        where = origin(url)
        allowed = self.camera.allowed_hosts  # host:port, or a host on any port
        if where != self.home and where not in allowed and where.rsplit(":", 1)[0] not in allowed:
            raise Refused(f"{where} is not the playlist's host ({self.home}) nor in allowed_hosts")

    def failed(self, exc: Exception) -> bytes:
        if self.error is None:
            self.error = exc
            raise exc
        return b""

    def __call__(self, url: str, flags: int, options: dict):
        if self.error is not None:
            return _Nothing()
        try:
            if flags & 2:  # AVIO_FLAG_WRITE: the demuxer only reads
                raise Refused("a write")
            self.check(url)
            p = urlsplit(url)
            clean = urlunsplit((p.scheme, p.netloc.rpartition("@")[2], p.path or "/", p.query, ""))  # no credentials
            request = urllib.request.Request(clean, headers={"User-Agent": "video-assets-recorder"})
            if self.auth and origin(clean) == self.home:
                request.add_unredirected_header("Authorization", self.auth)  # never sent on after a redirect
            return _Body(self, self.opener.open(request, timeout=self.camera.stall_s), clean)
        except Exception as exc:
            self.failed(exc)  # raises the connection's first error
            return _Nothing()
