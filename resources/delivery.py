"""Where alerts are delivered: the webhooks destinations file (``VIDEO_ALERT_DESTINATIONS``) and the HTTP
client that posts to them. The only place that reads a destination's token (from the environment, by the
name the file gives), and it never logs it.

One request is one POST to the configured URL and nothing else: a redirect is an answer, not followed (the
token goes to no other place), and the whole exchange (connect, send, status line and headers) has one
deadline, however slowly a receiver trickles its answer. Connects directly: no ``HTTP(S)_PROXY``."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
from urllib.parse import urlsplit

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.delivery.webhooks import Destination, load_destinations, request_body

MAX_ERROR_CHARS = 300  # an error is the receiver's words too (a garbage status line): a row stays small


class AlertDestinations(ConfigurableResource):
    config_file: str = Field(
        default="",
        description="TOML file of [[destination]] webhooks (docs/streams.md); empty: alerts are not delivered",
    )
    service_url: str = Field(
        default="http://127.0.0.1:8300",
        description="The service's address (VIDEO_SERVICE_URL), for clip links: alert payloads and promotion flips",
    )
    timeout_s: float = Field(default=10.0, gt=0, description="Seconds a destination has to answer")

    def destinations(self) -> list[Destination]:
        """The configured destinations; ValueError naming VIDEO_ALERT_DESTINATIONS for a bad file."""
        if not self.config_file:
            return []
        try:
            return load_destinations(self.config_file)
        except ValueError as exc:
            raise ValueError(f"VIDEO_ALERT_DESTINATIONS: {exc}") from exc

    def post(self, dest: Destination, body: dict, idempotency_key: str) -> tuple[int | None, str | None]:
        """(HTTP status, error) of one request; never raises (any failure is the error, None for a 2xx)."""
        headers = {"Content-Type": "application/json", "Idempotency-Key": idempotency_key}
        token = os.environ.get(dest.token_env) if dest.token_env else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            status = post_once(dest.url, request_body(body), headers, self.timeout_s)
        except Exception as exc:  # whatever a receiver makes the client raise is its failure
            error = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
            if token:  # a receiver echoing the token must not put it in a table
                error = error.replace(token, "***")
            return None, error[:MAX_ERROR_CHARS]
        if 200 <= status < 300:
            return status, None
        if 300 <= status < 400:
            return status, f"HTTP {status} redirect not followed"
        return status, f"HTTP {status}"


def post_once(url: str, data: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """The status a POST of ``data`` to ``url`` gets, within ``timeout_s`` in all; TimeoutError past it."""
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.netloc, timeout=timeout_s, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.netloc, timeout=timeout_s)
    expired = threading.Event()

    def cut() -> None:
        # Set first: a socket made after this read is caught by the check after connect().
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read (close() alone would not)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if expired.is_set():
            raise TimeoutError
        conn.request("POST", path, body=data, headers=headers)
        return conn.getresponse().status  # the body is not read: the status is the answer
    except Exception as exc:
        if expired.is_set():
            raise TimeoutError(f"no answer within {timeout_s:g} s") from exc
        raise
    finally:
        timer.cancel()
        conn.close()
