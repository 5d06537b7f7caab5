"""The alert delivery sensor: every few seconds, each alert not yet accepted by a destination is posted to
it (``core.delivery.webhooks``); each attempt is an ``alert_deliveries`` row, written after the answer."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from dagster import (
    AssetMaterialization,
    DefaultSensorStatus,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from video_assets.core.delivery.webhooks import SENT, Destination, alert_id, due, outcome, payload
from video_assets.core.tables import ALERT_DELIVERIES, ALERTS, KEYS, SCHEMAS, to_arrow

DELIVERY_INTERVAL_S = 10
MAX_PER_TICK = 200  # the rest wait for the next tick: a tick stays short


def deliver_due(tables: DeltaTables, delivery: AlertDestinations, now: datetime | None = None) -> dict:
    """Post every due (alert, destination); returns counts: sent, retrying, due, left.

    Each destination has its own thread, so a hung one delays no other; a destination that used a whole
    deadline gets no more requests this tick (its other alerts wait for the next: a tick stays short). Rows
    are written here, one thread, as answers come."""
    destinations = delivery.destinations()
    if not destinations or not tables.exists(ALERTS):
        return {"sent": 0, "retrying": 0, "due": 0, "left": 0}
    now = now or datetime.now(UTC)
    alerts = tables.read(ALERTS, SCHEMAS[ALERTS]).to_dicts()
    done = tables.read(ALERT_DELIVERIES, SCHEMAS[ALERT_DELIVERIES]).to_dicts()
    todo = due(alerts, done, destinations, now)
    counts = {"sent": 0, "retrying": 0, "due": len(todo), "left": len(todo)}
    per_dest: dict[str, list] = {}
    for item in todo[:MAX_PER_TICK]:
        per_dest.setdefault(item[1].name, []).append(item)
    rows: queue.Queue[dict | None] = queue.Queue()
    stop = threading.Event()  # the writer failed: post nothing it would not record

    def deliver(items: list) -> None:
        try:
            for alert, dest, before in items:
                if stop.is_set():
                    return
                started = time.monotonic()
                status, error = _attempt(delivery, alert, dest)
                rows.put(outcome(alert, dest, before, status, error, now))
                if status is None and time.monotonic() - started >= delivery.timeout_s:
                    return
        finally:
            rows.put(None)  # this destination is done

    with ThreadPoolExecutor(max_workers=max(1, len(per_dest)), thread_name_prefix="alert-delivery") as pool:
        futures = [pool.submit(deliver, items) for items in per_dest.values()]
        try:
            for _ in futures:
                while (row := rows.get()) is not None:
                    # One commit per attempt, after the answer: a crash before it re-sends with the same
                    # Idempotency-Key.
                    tables.merge(ALERT_DELIVERIES, to_arrow(ALERT_DELIVERIES, [row]), KEYS[ALERT_DELIVERIES])
                    counts["sent" if row["status"] == SENT else "retrying"] += 1
                    counts["left"] -= 1
        finally:
            stop.set()
    for future in futures:
        future.result()  # a bug of this module's own (not a destination's failure) is not swallowed
    return counts


def _attempt(delivery: AlertDestinations, alert: dict, dest: Destination) -> tuple[int | None, str | None]:
    """(status, error) of one delivery: anything raised is its error, so the loop goes on to the others."""
    try:
        return delivery.post(dest, payload(alert, dest, delivery.service_url), f"{alert_id(alert)}:{dest.name}")
    except Exception as exc:  # recorded on the row, retried with backoff
        return None, f"{exc.__class__.__name__}: {exc}"[:300]


@sensor(
    minimum_interval_seconds=DELIVERY_INTERVAL_S,
    default_status=DefaultSensorStatus.STOPPED,
    description="Posts each new alert to every webhook of VIDEO_ALERT_DESTINATIONS, once (Idempotency-Key), "
    "retrying a failed one with backoff; alert_deliveries records every attempt.",
)
def alert_delivery_sensor(context: SensorEvaluationContext, tables: DeltaTables, alert_delivery: AlertDestinations):
    counts = deliver_due(tables, alert_delivery)
    if not counts["due"]:
        return SkipReason("no alert to deliver")
    said = f"{counts['sent']} sent, {counts['retrying']} to retry, {counts['left']} left for the next tick"
    written = counts["sent"] + counts["retrying"]
    if not written:
        return SkipReason(said)
    context.log.info(said)
    metadata = {k: counts[k] for k in ("sent", "retrying", "left")}
    return SensorResult(asset_events=[AssetMaterialization(ALERT_DELIVERIES, metadata={"rows": written, **metadata})])
