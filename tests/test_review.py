"""The review queue's order, a reviewer's label (validated by the use case's own schema), and labels into the
golden set (core.review; pure). The page and its API over a real service: tests/test_search_service.py."""

import json
from datetime import UTC, datetime, timedelta

import polars as pl
import pyarrow as pa
import pytest
from pydantic import ValidationError

from video_assets.core.evaluation.golden import golden_rows, label_files, load_labels
from video_assets.core.review.labels import (
    CONFIRMED,
    CORRECTED,
    SKIPPED,
    export_jsonl,
    golden_with_reviews,
    label_input,
    label_row,
    labels_outside_clips,
    outside_clip,
)
from video_assets.core.review.queue import item_id, ranked
from video_assets.core.structuring.usecase import load
from video_assets.core.tables import CANDIDATE_EVENTS, REVIEW_LABELS, REVIEW_QUEUE, SCHEMAS

UC = "object_handling"
T0 = datetime(2026, 12, 1, tzinfo=UTC)
KEY = {"model_version": "1", "prompt_version": 1, "use_case": UC, "use_case_version": "u1", "structurer": "s"}
EVENT = {"start_s": 0.0, "end_s": 1.5, "actor": "person", "action": "lift", "object": "kettle"}


def queue_row(video: str, verdict, confidence=None, events=(), segment=0) -> dict:
    return {
        **KEY,
        "video_id": video,
        "segment": segment,
        "batch_key": "b1",
        "uri": f"/v/{video}.mp4",
        "caption_digest": "d",
        "start_s": 0.0,
        "end_s": 5.0,
        "verdict": verdict,
        "confidence": confidence,
        "events": list(events),
        "reason": "r",
        "excerpt": "a person lifts a kettle",
        "threshold": 0.7,
        "routed_at": T0,
    }


def frame(name: str, rows: list[dict]) -> pl.DataFrame:
    return pl.from_arrow(pa.Table.from_pylist(rows, schema=SCHEMAS[name]))


def test_the_queue_is_ranked_for_a_person_and_hides_what_was_decided():
    rows = [
        queue_row("retry", "suspected"),  # verdict-only retry, nobody disagrees
        queue_row("unparsed", None),
        queue_row("sure", "suspected", 0.6),
        queue_row("unsure", "suspected", 0.2, [EVENT]),
        queue_row("flip", "possible"),  # the challenger says none
        queue_row("other_case", "possible") | {"use_case": "loss_prevention"},
    ]
    challenger = frame(
        CANDIDATE_EVENTS,
        [{**queue_row("flip", "none"), "status": "parsed", "n_events": 0, "attempts": 1, "structured_at": T0}],
    )
    items = ranked(frame(REVIEW_QUEUE, rows), UC, None, challenger)
    assert [i["video_id"] for i in items] == ["unsure", "sure", "flip", "unparsed", "retry"]
    assert [i["tier"] for i in items] == [
        "low confidence",
        "low confidence",
        "challenger disagrees",
        "unparsed",
        "other",
    ]
    assert items[2]["challenger_verdicts"] == ["none"]
    assert items[0]["events"] == [EVENT] and items[0]["item_id"] == item_id(rows[3])
    # Decided items leave the queue; a skipped one goes to its end.
    labels = frame(
        REVIEW_LABELS,
        [
            label_row(items[0], _label(items[0], "save", "confirmed", [EVENT]), T0),
            label_row(items[1], _label(items[1], "skip"), T0),
        ],
    )
    after = ranked(frame(REVIEW_QUEUE, rows), UC, labels, challenger)
    assert [i["video_id"] for i in after] == ["flip", "unparsed", "retry", "sure"] and after[-1]["skipped"]


def _label(item: dict, action: str, verdict=None, events=(), label_id=None, reviewer="ann"):
    model = label_input(load(UC))
    body = {"label_id": label_id or f"id-{item['video_id']}-{action}", "item_id": item["item_id"], "action": action}
    if action == "save":
        body |= {"verdict": verdict, "events": list(events)}
    return model.model_validate(body | {"reviewer": reviewer})


def test_a_label_is_validated_by_the_use_cases_own_schema_and_says_what_the_person_decided():
    item = ranked(frame(REVIEW_QUEUE, [queue_row("v", "suspected", 0.3, [EVENT])]), UC)[0]
    assert label_row(item, _label(item, "save", "suspected", [EVENT]), T0)["decision"] == CONFIRMED
    corrected = label_row(item, _label(item, "save", "confirmed", [EVENT | {"end_s": 3.0}]), T0)
    assert corrected["decision"] == CORRECTED and corrected["events"][0]["end_s"] == 3.0
    assert corrected["model_verdict"] == "suspected" and corrected["model_events"] == [EVENT]
    assert label_row(item, _label(item, "skip"), T0)["decision"] == SKIPPED
    uc = load(UC)
    bad = [
        {"verdict": "confirmed", "events": [EVENT | {"end_s": -1}]},  # negative time
        {"verdict": "confirmed", "events": [EVENT | {"start_s": 2.0, "end_s": 1.0}]},  # ends before it starts
        {"verdict": "confirmed", "events": [EVENT | {"actor": "x" * (uc.max_text + 1)}]},  # the use case's bound
        {"verdict": "confirmed", "events": [EVENT] * (uc.max_events + 1)},
        {"verdict": "none", "events": [EVENT]},
        {"verdict": "maybe"},
        {"verdict": "confirmed", "extra": 1},
    ]
    for fields in bad:
        body = {"label_id": "abcdefgh", "item_id": item["item_id"], "action": "save", "reviewer": "ann", **fields}
        with pytest.raises(ValidationError):
            label_input(uc).model_validate(body)
    with pytest.raises(ValidationError):  # a skip that carries an answer
        label_input(uc).model_validate(
            {"label_id": "abcdefgh", "item_id": item["item_id"], "action": "skip", "reviewer": "a", "verdict": "none"}
        )


def test_event_times_are_numbers_inside_the_clip():
    """Issue 44: times of 5,000-80,000 s on a 4 s clip, strings and booleans were accepted as a label."""
    item = ranked(frame(REVIEW_QUEUE, [queue_row("v", "suspected", 0.3, [EVENT])]), UC)[0]
    model = label_input(load(UC))
    base = {"label_id": "abcdefgh", "item_id": item["item_id"], "action": "save", "reviewer": "ann"}
    for start, end in (("0", "1.5"), (0.0, "1.5"), (False, True), (0, True), (None, 1.0)):
        body = json.dumps(base | {"verdict": "confirmed", "events": [EVENT | {"start_s": start, "end_s": end}]})
        with pytest.raises(ValidationError) as exc:
            model.model_validate_json(body)
        assert "events.0." in str(exc.value), (start, end)
    fine = model.model_validate_json(json.dumps(base | {"verdict": "confirmed", "events": [EVENT | {"end_s": 4}]}))
    assert fine.events[0].end_s == 4.0  # an integer is a number
    # Inside a 4 s clip, up to its end and a little tolerance; the first field outside is named.
    assert outside_clip(fine.events, 4.0) is None and outside_clip([EVENT | {"end_s": 4.3}], 4.0) is None
    far = [EVENT, EVENT | {"start_s": 5000.0, "end_s": 80000.0}]
    assert outside_clip(far, 4.0) == "events[1].start_s: 5000 s is outside the clip (0-4 s)"
    assert outside_clip([EVENT | {"end_s": 80000.0}], 4.0) == "events[0].end_s: 80000 s is outside the clip (0-4 s)"
    # Stored labels are judged too (saved before the check): only where the video's duration is known.
    rows = [{"label_id": "a", "video_id": "v", "events": far}, {"label_id": "b", "video_id": "w", "events": far}]
    assert labels_outside_clips(rows, {"v": 4.0, "w": None}) == {"a": outside_clip(far, 4.0)}


def test_reviewed_labels_join_the_golden_set_replacing_and_listing_what_they_contradict():
    records, version = load_labels(label_files()[UC])
    shipped = golden_rows(UC, records, version)
    coffee = next(r for r in shipped if r["file"] == "sam2_04_coffee.mp4")
    item = {
        "item_id": "0" * 16,
        **KEY,
        "video_id": coffee["video_id"],
        "segment": 0,
        "uri": "/v/sam2_04_coffee.mp4",
        "verdict": "suspected",
        "confidence": 0.3,
        "events": [EVENT],
    }
    new = {"video_id": "a" * 64, "uri": "/v/new_clip.mp4"}
    labels = [
        label_row(item, _label(item, "save", "confirmed", [EVENT | {"end_s": 3.0}], "label-01", "ann"), T0),
        label_row(item | new, _label(item | new, "save", "none", [], "label-02", "ann"), T0),
        label_row(item | new, _label(item | new, "save", "possible", [EVENT], "label-03", "bob"), T0 + timedelta(1)),
        label_row(item, _label(item, "skip", label_id="label-04"), T0 + timedelta(2)),  # a skip changes nothing
    ]
    rows = golden_with_reviews(UC, shipped, version, labels)
    by_file = {r["file"]: r for r in rows}
    assert len(rows) == len(shipped) + 1
    got = by_file["sam2_04_coffee.mp4"]
    assert (got["source"], got["replaces_shipped"], got["reviewed_by"], got["label_id"]) == (
        "reviewed",
        True,
        "ann",
        "label-01",
    )
    assert got["events"][0]["end_s"] == 3.0
    assert json.loads(got["conflicts"]) == [{"source": "shipped", "verdict": "confirmed", "file": "sam2_04_coffee.mp4"}]
    # Two reviewers disagree on a new clip: the latest label is used, the other is listed.
    clip = by_file["new_clip.mp4"]
    assert (clip["verdict"], clip["reviewed_by"], clip["replaces_shipped"]) == ("possible", "bob", False)
    assert json.loads(clip["conflicts"])[0] | {"label_id": None} == {
        "source": "reviewed",
        "reviewer": "ann",
        "verdict": "none",
        "label_id": None,
    }
    untouched = [r for r in rows if r["source"] == "shipped"]
    assert all(r["conflicts"] is None for r in untouched) and len(untouched) == len(shipped) - 1
    versions = {r["labels_version"] for r in rows}
    assert len(versions) == 1 and versions != {version}  # a new version, the same for every row
    assert golden_with_reviews(UC, shipped, version, [])[0]["labels_version"] == version  # none reviewed
    assert golden_with_reviews(UC, shipped, version, labels[3:]) == golden_with_reviews(UC, shipped, version, [])
    # Exported in the use case's own format: the labels file loads it back.
    out = export_jsonl(rows)
    assert len(out.splitlines()) == len(rows)
    back = [json.loads(line) for line in out.splitlines()]
    assert next(b for b in back if b["file"] == "sam2_04_coffee.mp4")["events"][0]["end_s"] == 3.0


def test_exported_labels_load_as_a_labels_file(tmp_path):
    records, version = load_labels(label_files()[UC])
    rows = golden_with_reviews(UC, golden_rows(UC, records, version), version, [])
    path = tmp_path / "golden.jsonl"
    path.write_text(export_jsonl(rows))
    again, _ = load_labels(path)
    assert [r.model_dump() for r in again] == [r.model_dump() for r in sorted(records, key=lambda r: r.file)]


def test_the_latest_fact_diffs_flips_are_review_items():
    from video_assets.core.tables import PROMOTION_DIFFS

    def diff(video, change, decision, at):
        return {
            "decision_id": decision, "use_case": UC, "video_id": video, "uri": f"/v/{video}.mp4", "sample": "golden",
            "expected": "none", "change": change, "production_verdict": "none", "challenger_verdict": "confirmed",
            "production_events": [], "challenger_events": [EVENT], "start_s": 0.0, "end_s": 1.5,
            "model_version": "1", "prompt_version": 1, "use_case_version": "u1", "structurer": "s",
            "challenger_model_version": "2", "challenger_prompt_version": 1, "diffed_at": at,
        }  # fmt: skip

    diffs = frame(
        PROMOTION_DIFFS,
        [
            diff("old", "flag_gained", "d1", T0),  # an older decision's flip: not shown
            diff("flipped", "flag_gained", "d2", T0 + timedelta(1)),
            diff("same", "same", "d2", T0 + timedelta(1)),
        ],
    )
    items = ranked(frame(REVIEW_QUEUE, [queue_row("sure", "suspected", 0.6), queue_row("x", None)]), UC, diffs=diffs)
    assert [(i["video_id"], i["tier"]) for i in items] == [
        ("sure", "low confidence"),
        ("flipped", "challenger disagrees"),
        ("x", "unparsed"),
    ]
    flip = items[1]
    assert flip["segment"] == -1 and flip["challenger_verdicts"] == ["confirmed"] and "flag_gained" in flip["reason"]
    # A label on the flip is like any other: the whole video's answer.
    row = label_row(flip, _label(flip, "save", "confirmed", [EVENT]), T0)
    assert (row["segment"], row["decision"], row["model_verdict"]) == (-1, "corrected", "none")
