"""The fact diff of a challenger: per video and use case, what production and the challenger answer, side by
side, with the changes that matter to a user first. Pure.

A video's answer is ``metrics.video_predictions``' (its most severe answered verdict, all its events). The
change kinds, most consequential first:

- ``flag_lost`` / ``flag_gained``: flagged (confirmed, suspected) on one side only: an alert appears or vanishes;
- ``verdict_changed``: another verdict on the same side of the flag (confirmed -> suspected, possible -> none);
- ``unparsed_now`` / ``parsed_now``: the challenger could not answer where production could, or the reverse;
- ``events_changed``: the same verdict, events appearing or vanishing (no temporal IoU match at the threshold);
- ``same``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from video_assets.core.evaluation.metrics import Event, match_events
from video_assets.core.vocabulary import FLAGGED, UNPARSED

FLAG_LOST, FLAG_GAINED, VERDICT_CHANGED = "flag_lost", "flag_gained", "verdict_changed"
UNPARSED_NOW, PARSED_NOW, EVENTS_CHANGED, SAME = "unparsed_now", "parsed_now", "events_changed", "same"
KINDS = (FLAG_LOST, FLAG_GAINED, VERDICT_CHANGED, UNPARSED_NOW, PARSED_NOW, EVENTS_CHANGED, SAME)
FLIPS = frozenset(KINDS) - {SAME}


def _events(p: Mapping | None) -> list[Event]:
    return list((p or {}).get("events") or [])


def change(production: Mapping | None, challenger: Mapping | None, iou_threshold: float = 0.3) -> str:
    """The kind of change from production's answer for a video to the challenger's (KINDS)."""
    before = (production or {}).get("verdict", UNPARSED)
    after = (challenger or {}).get("verdict", UNPARSED)
    if before != UNPARSED and after == UNPARSED:
        return UNPARSED_NOW
    if before == UNPARSED and after != UNPARSED:
        return PARSED_NOW
    if (before in FLAGGED) != (after in FLAGGED):
        return FLAG_LOST if before in FLAGGED else FLAG_GAINED
    if before != after:
        return VERDICT_CHANGED
    _, appeared, vanished, _ = match_events(_events(production), _events(challenger), iou_threshold)
    return EVENTS_CHANGED if appeared or vanished else SAME


def _span(*answers: Mapping | None) -> tuple[float | None, float | None]:
    events = [e for a in answers for e in _events(a)]
    if not events:
        return None, None
    return min(e.start_s for e in events), max(e.end_s for e in events)


def _event_dicts(p: Mapping | None) -> list[dict]:
    return [
        {"start_s": e.start_s, "end_s": e.end_s, "actor": "", "action": e.action, "object": e.object}
        for e in _events(p)
    ]


def fact_diff(
    videos: Sequence[Mapping],
    production: Mapping[str, dict],
    challenger: Mapping[str, dict],
    iou_threshold: float = 0.3,
) -> list[dict]:
    """One row per video of ``videos`` (``video_id``, ``uri``, ``sample``: golden | shadow, ``expected``:
    the golden verdict or None): both answers, the change, and the time range to look at; flips first."""
    order = {k: i for i, k in enumerate(KINDS)}
    rows = []
    for v in videos:
        p, c = production.get(v["video_id"]), challenger.get(v["video_id"])
        start, end = _span(p, c)
        rows.append(
            {
                "video_id": v["video_id"],
                "uri": v.get("uri"),
                "sample": v.get("sample", "golden"),
                "expected": v.get("expected"),
                "production_verdict": (p or {}).get("verdict", UNPARSED),
                "challenger_verdict": (c or {}).get("verdict", UNPARSED),
                "production_events": _event_dicts(p),
                "challenger_events": _event_dicts(c),
                "change": change(p, c, iou_threshold),
                "start_s": start,
                "end_s": end,
            }
        )
    return sorted(rows, key=lambda r: (order[r["change"]], r["sample"], r["uri"] or "", r["video_id"]))


def counts(rows: Sequence[Mapping]) -> dict[str, int]:
    """Rows per change kind (every kind, zeros included), flips first."""
    return {k: sum(r["change"] == k for r in rows) for k in KINDS}
