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


def _caps(split: str, ends: list[float]):
    """One video's caption rows under a split: a segment per end time."""
    import polars as pl

    starts = [0.0, *ends[:-1]]
    return pl.DataFrame(
        {
            "video_id": "a",
            "segment": list(range(len(ends))),
            "batch_key": "b1",
            "model_version": "1",
            "prompt_version": 1,
            "split": split,
            "segment_start_s": starts,
            "segment_end_s": ends,
            "status": "ok",
            "prose": [f"caption {i}" for i in range(len(ends))],
        },
        schema_overrides={"segment": pl.Int32, "prompt_version": pl.Int32},
    )


def test_a_new_split_makes_the_old_rows_stale_and_restructures_the_video():
    """plan_structuring keys structured rows on their caption's digest: after a re-split every old row
    is stale (even segment 0, same index, other window), every new caption is to do, and the checks
    find the old rows without a caption and the new captions without rows until the plan is applied."""
    import polars as pl

    from video_assets.core.structuring.usecase import load
    from video_assets.core.structuring.versions import captions_without_rows, plan_structuring, rows_without_caption
    from video_assets.core.tables import SCHEMAS, STRUCTURED_EVENTS

    uc = load("object_handling")
    sid = "m/v1"
    whole = _caps("segment_s=none", [9.6])
    plan = plan_structuring(whole, pl.from_arrow(SCHEMAS[STRUCTURED_EVENTS].empty_table()), [uc], sid)
    assert [c["segment"] for c in plan.todo[uc.name]] == [0] and plan.stale == 0 and plan.affected == ["a"]
    done = pl.DataFrame(
        [{**c, "use_case": uc.name, "use_case_version": uc.version, "structurer": sid} for c in plan.todo[uc.name]]
    )
    assert plan_structuring(whole, done, [uc], sid).affected == []  # nothing changed: nothing to do
    assert captions_without_rows(whole, done, {uc.name: uc.version}, sid).is_empty()

    split = _caps("segment_s=3", [3.0, 6.0, 9.6])
    again = plan_structuring(split, done, [uc], sid)
    assert [c["segment"] for c in again.todo[uc.name]] == [0, 1, 2]
    assert again.stale == 1 and again.affected == ["a"] and again.keep.is_empty()
    assert rows_without_caption(done, split).height == 1  # the 0-9.6 s row describes no current caption
    assert captions_without_rows(split, done, {uc.name: uc.version}, sid).height == 3
    # A recaption that says the same over the same windows keeps its digests: nothing to redo.
    assert plan_structuring(whole.with_columns(captioned_at=pl.lit(1)), done, [uc], sid).affected == []
    # Rows written before the digest existed match no caption: restructured, not trusted.
    legacy = done.drop("caption_digest")
    assert plan_structuring(whole, legacy, [uc], sid).stale == 1
    assert rows_without_caption(legacy, whole).is_empty()  # not judged by the check (counted apart)


def test_a_camera_alert_is_placed_in_the_cameras_own_time():
    from datetime import UTC, datetime, timedelta

    from video_assets.core.routing import wall_clock

    began = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    segment = {"camera": "dock", "started_at": began}
    row = {"start_s": 4.0, "end_s": 6.5}
    got = wall_clock(row, segment, began + timedelta(seconds=50))
    assert got == {
        "camera": "dock",
        "wall_start": began + timedelta(seconds=4),
        "wall_end": began + timedelta(seconds=6.5),
        "detected_after_s": 46.0,
    }
    assert wall_clock(row, None, began)["camera"] is None  # an uploaded file: no camera time
    # A row without event times (unparsed, verdict only) is about the whole segment.
    whole = wall_clock(
        {"start_s": None}, {**segment, "ended_at": began + timedelta(seconds=30)}, began + timedelta(seconds=45)
    )
    assert (whole["wall_start"], whole["wall_end"]) == (began, began + timedelta(seconds=30))
    assert whole["detected_after_s"] == 45.0


def test_a_flagged_row_whose_every_event_fell_outside_its_clip_is_reviewed_not_alerted():
    """Issue 44: the events were dropped but the alert was raised on the bare verdict. The row comes from
    the real structuring policy (a model pinned to answer 223-224 s on a 9.6 s clip)."""
    from tests.test_structuring import _answer, _Pinned
    from video_assets.core.structuring.policy import structure_captions
    from video_assets.core.structuring.usecase import load

    chaplin = {"status": "ok", "prose": "A man picks up a cup.", "segment_start_s": 0.0, "segment_end_s": 9.6}
    uc = load("object_handling")
    keys = {"video_id": "v", "segment": 0, "segment_start_s": 0.0, "segment_end_s": 9.6}  # as structured_events
    [gone] = structure_captions(_Pinned(_answer((223.0, 224.0), (300.0, 301.0))), uc, [chaplin], 1024, 16)
    [kept] = structure_captions(_Pinned(_answer((2.0, 3.0), (223.0, 224.0))), uc, [chaplin], 1024, 16)
    assert (gone["verdict"], gone["confidence"], gone["events"], gone["events_outside"]) == ("confirmed", 0.9, [], 2)
    alerts, review = split([keys | gone], 0.7, {})
    assert alerts == [] and len(review) == 1
    assert review[0]["reason"] == (
        "confirmed with every event outside the clip: dropped 2 event(s) outside the clip (0-9.6 s): 223-224 s, 300-301 s"
    )
    assert (review[0]["start_s"], review[0]["end_s"]) == (0.0, 9.6)  # the whole clip for a person to watch
    # One event left inside the clip: the alert stands on it.
    assert route(kept, 0.7)[0] == "alerts" and kept["events_outside"] == 1
    # A verdict with no events at all (none were placed) still alerts: nothing was dropped.
    assert route(row("confirmed", 0.9), 0.7)[0] == "alerts"
