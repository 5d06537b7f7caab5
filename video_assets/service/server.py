"""Build the searcher from model folders and an index, and serve the app with uvicorn."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from pathlib import Path

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8300
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")


class IndexMissing(FileNotFoundError):
    """No search index yet: the message says what to run."""


def build_searcher(
    index_uri: str,
    text_model: str | Path,
    frame_model: str | Path | None = None,
    text_version: str | None = None,
    frame_version: str | None = None,
):
    """A ``LanceSearcher`` on ``index_uri`` with the text encoder in ``text_model`` (and the frame
    encoder in ``frame_model``, for image uploads); ``IndexMissing`` when the index is not there."""
    from video_assets.core.search.index import LanceSearcher, index_exists

    if not index_exists(index_uri):
        raise IndexMissing(
            f"no search index at {index_uri}: run `make demo` first (it materialises search_index), "
            "or point VIDEO_INDEX_URI at an existing index"
        )
    from video_assets.core.embeddings.text import TextEncoder

    frames = None
    if frame_model is not None:
        from video_assets.core.embeddings.job import load_frame_encoder

        frames = load_frame_encoder(frame_model)
    return LanceSearcher(index_uri, TextEncoder(text_model), frames, text_version, frame_version)


def _host_name(address: str) -> str:
    """``address`` as it appears in a Host header: an IPv6 literal in brackets, without a zone."""
    address = address.split("%", 1)[0]
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address.lower()


def _local_addresses() -> list[str]:
    """Every address of this machine's interfaces, and its host name (what a wildcard bind answers on)."""
    import socket

    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs]
    return [socket.gethostname(), *(a for a in found if _is_ip(a))]  # not the link-layer (MAC) ones


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])
        return True
    except ValueError:
        return False


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> list[str]:
    """The Host headers the service answers: localhost, its bind address (every interface's address and the
    host name for a wildcard bind) and ``extra``. A page on another name that resolves here (DNS rebinding)
    cannot read the archive through the browser of someone who can reach it."""
    extra = [e.strip().lower() for e in extra if e.strip()]
    for name in extra:  # TrustedHostMiddleware's own rule, said with the setting's name
        if "*" in name[1:] or (name.startswith("*") and name != "*" and not name.startswith("*.")):
            raise ValueError(f"VIDEO_SERVICE_ALLOWED_HOSTS: {name!r}: a wildcard is '*' or a leading '*.'")
    wildcard = bind in ("", "0.0.0.0", "::")
    bound = _local_addresses() if wildcard else [bind]
    names = [*LOOPBACK, *(_host_name(b) for b in bound), *extra]
    return list(dict.fromkeys(n for n in names if n))


def serve(app, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, extra_hosts: Iterable[str] | None = None) -> None:
    """Run ``app`` under uvicorn, answering only the Host headers of ``allowed_hosts`` (``extra_hosts``:
    VIDEO_SERVICE_ALLOWED_HOSTS when not given); any other gets 400."""
    import uvicorn
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    if extra_hosts is None:
        from resources.settings import service_allowed_hosts

        extra_hosts = service_allowed_hosts()
    allowed = allowed_hosts(host, extra_hosts)
    guarded = TrustedHostMiddleware(app, allowed_hosts=allowed, www_redirect=False)
    uvicorn.run(guarded, host=host, port=port, log_level="info", access_log=False)
