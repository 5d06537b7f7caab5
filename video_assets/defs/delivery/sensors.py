"""The alert delivery sensor: every few seconds, each alert not yet accepted by a destination is posted to
it (``core.delivery.webhooks``); each attempt is an ``alert_deliveries`` row, written after the answer."""

from __future__ import annotations

from datetime import UTC, datetime

from dagster import DefaultSensorStatus, SensorEvaluationContext, SkipReason, sensor

from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from video_assets.core.delivery.webhooks import SENT, alert_id, due, outcome, payload
from video_assets.core.tables import ALERT_DELIVERIES, ALERTS, KEYS, SCHEMAS, to_arrow

DELIVERY_INTERVAL_S = 10
MAX_PER_TICK = 200  # the rest wait for the next tick: a tick stays short


def deliver_due(tables: DeltaTables, delivery: AlertDestinations, now: datetime | None = None) -> dict:
    """Post every due (alert, destination); returns counts: sent, retrying, due, left."""
    destinations = delivery.destinations()
    if not destinations or not tables.exists(ALERTS):
        return {"sent": 0, "retrying": 0, "due": 0, "left": 0}
    now = now or datetime.now(UTC)
    alerts = tables.read(ALERTS, SCHEMAS[ALERTS]).to_dicts()
    done = tables.read(ALERT_DELIVERIES, SCHEMAS[ALERT_DELIVERIES]).to_dicts()
    todo = due(alerts, done, destinations, now)
    counts = {"sent": 0, "retrying": 0, "due": len(todo), "left": max(0, len(todo) - MAX_PER_TICK)}
    for alert, dest, before in todo[:MAX_PER_TICK]:
        body = payload(alert, dest, delivery.service_url)
        status, error = delivery.post(dest, body, f"{alert_id(alert)}:{dest.name}")
        row = outcome(alert, dest, before, status, error, now)
        # One commit per attempt, after the answer: a crash before it re-sends with the same Idempotency-Key.
        tables.merge(ALERT_DELIVERIES, to_arrow(ALERT_DELIVERIES, [row]), KEYS[ALERT_DELIVERIES])
        counts["sent" if row["status"] == SENT else "retrying"] += 1
    return counts


@sensor(
    minimum_interval_seconds=DELIVERY_INTERVAL_S,
    default_status=DefaultSensorStatus.STOPPED,
    description="Posts each new alert to every webhook of VIDEO_ALERT_DESTINATIONS, once (Idempotency-Key), "
    "retrying a failed one with backoff; alert_deliveries records every attempt.",
)
def alert_delivery_sensor(context: SensorEvaluationContext, tables: DeltaTables, alert_delivery: AlertDestinations):
    counts = deliver_due(tables, alert_delivery)
    return SkipReason(
        f"{counts['sent']} sent, {counts['retrying']} to retry, {counts['left']} left for the next tick"
        if counts["due"]
        else "no alert to deliver"
    )
