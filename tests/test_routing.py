"""Routing by threshold, both sides of the boundary."""

import pytest

from video_assets.core.routing import evidence, route, split


def row(verdict, confidence, status="parsed", events=()):
    return {
        "video_id": "v",
        "segment": 0,
        "status": status,
        "verdict": verdict,
        "confidence": confidence,
        "events": list(events),
        "segment_start_s": 0.0,
        "segment_end_s": 30.0,
    }


@pytest.mark.parametrize("verdict", ["confirmed", "suspected"])
def test_flagged_rows_split_at_the_threshold(verdict):
    assert route(row(verdict, 0.70), 0.7)[0] == "alerts"  # at the threshold: alert
    assert route(row(verdict, 0.71), 0.7)[0] == "alerts"
    assert route(row(verdict, 0.69), 0.7)[0] == "review_queue"
    assert route(row(verdict, 0.69), 0.6)[0] == "alerts"


def test_other_rows():
    assert route(row("possible", 0.99), 0.7)[0] == "review_queue"
    assert route(row("none", 0.99), 0.7)[0] is None
    assert route(row("confirmed", None, status="retried"), 0.7)[0] == "review_queue"
    assert route(row(None, None, status="unparsed"), 0.7)[0] == "review_queue"
    assert route(row(None, None, status="no_caption"), 0.7)[0] is None


def test_split_carries_evidence():
    ev = [
        {"start_s": 6.0, "end_s": 7.0, "actor": "hand", "action": "pick up", "object": "bottle"},
        {"start_s": 11.0, "end_s": 13.0, "actor": "hand", "action": "put back", "object": "bottle"},
    ]
    rows = [row("confirmed", 0.9, events=ev), row("possible", 0.5), row("none", 1.0)]
    rows[1]["segment"] = 1
    alerts, review = split(rows, 0.7, {("v", 0): "A hand picks up a bottle. " * 30, ("v", 1): "Maybe."})
    assert len(alerts) == 1 and len(review) == 1
    assert (alerts[0]["start_s"], alerts[0]["end_s"]) == (6.0, 13.0)
    assert len(alerts[0]["excerpt"]) == 300 and alerts[0]["excerpt"].endswith("…")
    assert (review[0]["start_s"], review[0]["end_s"], review[0]["excerpt"]) == (0.0, 30.0, "Maybe.")
    assert "0.90 >= 0.70" in alerts[0]["reason"] and alerts[0]["threshold"] == 0.7
    assert evidence(row("possible", 0.5), None)["excerpt"] == ""


def test_missing_structured_rows_finds_a_dropped_caption():
    import polars as pl

    from video_assets.defs.structuring.checks import missing_structured_rows

    caps = pl.DataFrame(
        {
            "video_id": ["a", "b", "c"],
            "segment": [0, 0, 0],
            "batch_key": ["b1"] * 3,
            "model_version": ["1"] * 3,
            "prompt_version": [1] * 3,
        }
    )
    base = {
        "segment": 0,
        "batch_key": "b1",
        "model_version": "1",
        "prompt_version": 1,
        "use_case_version": "x",
        "structurer": "m/v1",
    }
    events = pl.DataFrame(
        [
            {**base, "video_id": v, "use_case": u}
            for v, u in [("a", "oh"), ("b", "oh"), ("c", "oh"), ("a", "lp"), ("c", "lp")]
        ]
    )
    missing = missing_structured_rows(caps, events)
    assert missing.select("video_id", "use_case").rows() == [("b", "lp")]
    assert missing_structured_rows(caps, events.filter(pl.col("use_case") == "oh")).is_empty()
