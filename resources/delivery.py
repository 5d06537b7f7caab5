"""Where alerts are delivered: the webhook destinations file (``VIDEO_ALERT_DESTINATIONS``) and the HTTP
client that posts to them. The only place that reads a destination's token (from the environment, by the
name the file gives), and it never logs it."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from dagster import ConfigurableResource
from pydantic import Field

from video_assets.core.delivery.webhooks import Destination, load_destinations, request_body


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
        """(HTTP status, error) of one request; never raises for a destination's failure."""
        headers = {"Content-Type": "application/json", "Idempotency-Key": idempotency_key}
        if dest.token_env and os.environ.get(dest.token_env):
            headers["Authorization"] = f"Bearer {os.environ[dest.token_env]}"
        req = urllib.request.Request(dest.url, data=request_body(body), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, None
        except urllib.error.HTTPError as exc:
            return exc.code, f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # refused, timed out, unreachable: no answer
            return None, exc.__class__.__name__
