"""Webhook destinations, alert payloads and the delivery plan. Pure (no HTTP here: ``resources.delivery``
posts).

Destinations are a TOML file of ``[[destination]]`` tables::

    [[destination]]
    name = "ops"                              # letters, digits, - and _
    url = "https://hooks.example/alerts"      # http(s)
    format = "json"                           # json (the alert as JSON) | slack (an incoming-webhook body)
    token_env = "OPS_WEBHOOK_TOKEN"           # optional: sent as "Authorization: Bearer <token>", read from
                                              # the environment, never stored, logged or put in a payload

Each (alert, destination) is one ``alert_deliveries`` row. An alert's id hashes its key (the structuring key
of its row), so a batch routed again does not make its alerts new; every request carries
``Idempotency-Key: <alert id>:<destination>``, the same on every retry, so a receiver that saw it already
(the sender died after the receiver answered, before the row said so) can drop the repeat. A destination
that does not answer 2xx is tried again after 10 s, doubling to an hour, forever: a failure is recorded
(``error``, ``attempts``), never lost and never given up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from video_assets.core.config_files import load_entries
from video_assets.core.links import clip_url

SENT, RETRYING = "sent", "retrying"
FIRST_RETRY_S, MAX_RETRY_S = 10.0, 3600.0
ALERT_KEY = ("video_id", "segment", "use_case", "model_version", "prompt_version", "use_case_version", "structurer")


class Destination(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    url: str = Field(min_length=1, max_length=2048)
    format: Literal["json", "slack"] = "json"
    token_env: str | None = Field(default=None, pattern=r"^[A-Z_][A-Z0-9_]*$")

    @field_validator("url")
    @classmethod
    def http_only(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL")
        if parts.username or parts.password:
            raise ValueError("credentials belong in token_env, not in the URL")
        return url


def load_destinations(path: str | Path) -> list[Destination]:
    """The destinations of a file; ValueError naming the file and the destination for anything wrong."""
    return load_entries(path, "destination", Destination)


def alert_id(row: Mapping) -> str:
    return hashlib.sha256("\x1f".join(str(row[k]) for k in ALERT_KEY).encode()).hexdigest()[:20]


def payload(alert: Mapping, destination: Destination, service_url: str) -> dict:
    """The body for ``destination``: what happened, when, where to look. A camera's alert carries its camera
    and wall-clock range already (``routing.wall_clock``, set when it was routed)."""
    start, end = alert.get("start_s"), alert.get("end_s")
    clip = clip_url(service_url, alert["video_id"], start, end)
    wall = None
    if alert.get("wall_start") is not None:
        wall = {"start": alert["wall_start"].isoformat(), "end": alert["wall_end"].isoformat()}
    body = {
        "alert_id": alert_id(alert),
        "use_case": alert["use_case"],
        "verdict": alert.get("verdict"),
        "confidence": alert.get("confidence"),
        "video_id": alert["video_id"],
        "segment": alert["segment"],
        "uri": alert.get("uri"),
        "camera": alert.get("camera"),
        "start_s": start,
        "end_s": end,
        "wall_clock": wall,
        "excerpt": alert.get("excerpt"),
        "clip": clip,
        "reason": alert.get("reason"),
    }
    if destination.format == "json":
        return body
    where = f" on {body['camera']}" if body["camera"] else ""
    when = f" at {wall['start']}" if wall else (f" at {start:g} s" if start is not None else "")
    conf = f" ({body['confidence']:.2f})" if body["confidence"] is not None else ""
    text = f"*{body['use_case']}*: {body['verdict']}{conf}{where}{when}. {body['excerpt'] or ''} <{clip}|play the clip>"
    return {"text": text.strip()}


def due(
    alerts: Sequence[Mapping], deliveries: Sequence[Mapping], destinations: Sequence[Destination], now: datetime
) -> list[tuple[Mapping, Destination, Mapping | None]]:
    """(alert, destination, its delivery row or None) for every delivery to try now: never sent, and new or
    past its next attempt time; oldest alerts first."""
    known = {(d["alert_id"], d["destination"]): d for d in deliveries}
    out = []
    for alert in sorted(alerts, key=lambda a: (a.get("routed_at") or now, alert_id(a))):
        for dest in destinations:
            row = known.get((alert_id(alert), dest.name))
            if row is None or (row["status"] != SENT and row["next_attempt_at"] <= now):
                out.append((alert, dest, row))
    return out


def outcome(
    alert: Mapping, dest: Destination, before: Mapping | None, status: int | None, error: str | None, now: datetime
) -> dict:
    """The alert_deliveries row after one attempt (``status``: the HTTP status, None when no answer)."""
    attempts = (before["attempts"] if before else 0) + 1
    ok = status is not None and 200 <= status < 300
    wait = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (attempts - 1))
    return {
        "alert_id": alert_id(alert),
        "destination": dest.name,
        "video_id": alert["video_id"],
        "use_case": alert["use_case"],
        "status": SENT if ok else RETRYING,
        "attempts": attempts,
        "http_status": status,
        "error": None if ok else (error or f"HTTP {status}"),
        "first_attempt_at": before["first_attempt_at"] if before else now,
        "last_attempt_at": now,
        "next_attempt_at": now if ok else now + timedelta(seconds=wait),
        "sent_at": now if ok else None,
    }


def request_body(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, default=str).encode()
