"""Scoring functions on hand-built cases with known answers."""

import pytest

from video_assets.evaluation import (
    Event,
    bootstrap_ci,
    confusion_matrix,
    coverage,
    event_scores,
    flagged_scores,
    match_events,
    per_class,
    temporal_iou,
)


def test_perfect_predictions():
    labels = ["confirmed", "none", "possible", "none"]
    assert flagged_scores(labels, labels) == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 1}
    assert all(s["f1"] == 1.0 for s in per_class(labels, labels).values())
    assert confusion_matrix(labels, labels) == [[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 2]]


def test_all_wrong():
    expected = ["confirmed", "confirmed", "none"]
    predicted = ["none", "none", "suspected"]
    assert flagged_scores(expected, predicted) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 2}
    assert per_class(expected, predicted)["confirmed"]["recall"] == 0.0
    assert confusion_matrix(expected, predicted)[0] == [0, 0, 0, 2]


def test_partial_binary():
    expected = ["confirmed", "confirmed", "none", "none"]
    predicted = ["confirmed", "none", "suspected", "none"]
    s = flagged_scores(expected, predicted)
    assert s["precision"] == 0.5 and s["recall"] == 0.5 and s["f1"] == 0.5


def test_empty_inputs():
    assert flagged_scores([], [])["f1"] == 1.0  # nothing to find, nothing claimed
    assert event_scores({}, {})["f1"] == 1.0
    assert event_scores({"v": [Event(0, 1)]}, {})["recall"] == 0.0
    assert coverage([]) == {"rows": 0, "unparsed": 0, "unparsed_rate": 0.0}


def test_temporal_iou_partial_overlap():
    assert temporal_iou(Event(0, 4), Event(2, 6)) == pytest.approx(2 / 6)
    assert temporal_iou(Event(0, 1), Event(2, 3)) == 0.0
    assert temporal_iou(Event(1, 3), Event(1, 3)) == 1.0


def test_event_matching_is_one_to_one_and_thresholded():
    expected = [Event(6, 7), Event(11, 13)]
    predicted = [Event(6, 8), Event(6.2, 7.2), Event(30, 31)]
    tp, fp, fn, ious = match_events(expected, predicted, iou_threshold=0.3)
    assert (tp, fp, fn) == (1, 2, 1)
    assert ious == [pytest.approx(0.8 / 1.2)]
    assert match_events(expected, predicted, iou_threshold=0.9)[0] == 0


def test_bootstrap_interval_contains_the_point_estimate():
    expected = ["confirmed"] * 5 + ["none"] * 15
    predicted = ["confirmed"] * 4 + ["none"] * 14 + ["suspected", "none"]
    point = flagged_scores(expected, predicted)["f1"]
    lo, hi = bootstrap_ci(expected, predicted, n=300)
    assert lo <= point <= hi and lo < hi
    assert bootstrap_ci(expected, expected, n=50) == (1.0, 1.0)


def test_coverage_counts_unparsed():
    assert coverage(["ok", "unparsed", "ok", "ok"])["unparsed_rate"] == 0.25
