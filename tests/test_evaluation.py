"""Scoring functions on hand-built cases with known answers."""

import pytest

from video_assets.core.evaluation.metrics import (
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


# -- score_use_case: from rows to scores -----------------------------------------------------------

from video_assets.core.evaluation.metrics import score_use_case, video_predictions  # noqa: E402


def _golden():
    return [
        {
            "video_id": "a",
            "file": "a.mp4",
            "verdict": "confirmed",
            "events": [{"start_s": 6, "end_s": 7, "action": "pick up", "object": "cup"}],
        },
        {"video_id": "b", "file": "b.mp4", "verdict": "none", "events": []},
        {"video_id": "c", "file": "c.mp4", "verdict": "none", "events": []},
        {"video_id": "d", "file": "d.mp4", "verdict": "possible", "events": []},
    ]


def _seg(vid, status, verdict, events=(), segment=0):
    return {
        "video_id": vid,
        "segment": segment,
        "status": status,
        "verdict": verdict,
        "events": [{"start_s": s, "end_s": e, "action": "x", "object": "y"} for s, e in events],
    }


def test_segments_combine_to_the_most_severe_answered_verdict():
    preds = video_predictions(
        [
            _seg("a", "parsed", "none"),
            _seg("a", "parsed", "suspected", [(6, 8)], 1),
            _seg("a", "unparsed", None, segment=2),
            _seg("b", "unparsed", None),
            _seg("c", "retried", "possible"),
            _seg("c", "no_caption", None, segment=1),
        ]
    )
    assert preds["a"]["verdict"] == "suspected" and len(preds["a"]["events"]) == 1
    assert preds["b"]["verdict"] == "unparsed" and preds["c"]["verdict"] == "possible"


def test_score_use_case_perfect_and_partial():
    g = _golden()
    perfect = video_predictions(
        [
            _seg("a", "parsed", "confirmed", [(6, 7)]),
            _seg("b", "parsed", "none"),
            _seg("c", "parsed", "none"),
            _seg("d", "parsed", "possible"),
        ]
    )
    s = score_use_case(g, perfect, n_boot=50)
    m = s["metrics"]
    assert (m["flagged_f1"], m["accuracy"], m["event_f1"], m["coverage"], m["macro_f1"]) == (1.0, 1.0, 1.0, 1.0, 1.0)
    assert s["confusion"]["matrix"] == [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 2, 0]]

    # a: flagged but the event half overlaps (IoU 0.5); b unparsed; c a false alarm; d never structured.
    partial = video_predictions(
        [
            _seg("a", "parsed", "confirmed", [(6.5, 7.5)]),
            _seg("b", "unparsed", None),
            _seg("c", "parsed", "suspected", [(1, 2)]),
        ]
    )
    s = score_use_case(g, partial, iou_threshold=0.3, n_boot=50)
    m = s["metrics"]
    assert s["scored_videos"] == 3 and s["missing"] == ["d.mp4"]
    assert m["flagged_precision"] == 0.5 and m["flagged_recall"] == 1.0
    assert m["coverage"] == pytest.approx(2 / 3) and m["unparsed_rate"] == pytest.approx(1 / 3)
    assert m["event_precision"] == 0.5 and m["event_recall"] == 1.0
    assert m["mean_iou"] == pytest.approx(1 / 3)  # [6,7] vs [6.5,7.5]: 0.5 / 1.5
    assert s["confusion"]["matrix"][3] == [0, 1, 0, 0, 1]  # expected none: one suspected, one unparsed
    # A stricter IoU turns the half-overlap into a miss.
    assert score_use_case(g, partial, iou_threshold=0.5, n_boot=50)["metrics"]["event_recall"] == 0.0


def test_score_use_case_with_no_predictions():
    s = score_use_case(_golden(), {}, n_boot=10)
    assert s["scored_videos"] == 0 and s["metrics"]["coverage"] == 0.0 and len(s["missing"]) == 4


# -- the promotion gate: a paired bootstrap over the golden videos -----------------------------------


def _gate_inputs(flip: set[str] = frozenset()):
    """The object_handling golden set, a production that answers every label right, and a challenger that
    answers right but for the files in ``flip`` (confirmed -> none, none -> confirmed)."""
    from video_assets.core.evaluation.golden import golden_rows, label_files, load_labels
    from video_assets.core.evaluation.metrics import Event

    records, version = load_labels(label_files()["object_handling"])
    golden = golden_rows("object_handling", records, version)

    def answer(g, flipped):
        verdict = g["verdict"]
        if flipped:
            verdict = "none" if verdict != "none" else "confirmed"
        events = [Event(e["start_s"], e["end_s"], e["action"], e["object"]) for e in g["events"]]
        return {"verdict": verdict, "events": [] if verdict == "none" else events, "answered": True}

    production = {g["video_id"]: answer(g, False) for g in golden}
    challenger = {g["video_id"]: answer(g, g["file"] in flip) for g in golden}
    return golden, production, challenger


def test_the_gate_promotes_an_equal_challenger_and_records_its_intervals():
    from video_assets.core.evaluation.gate import GATED, PROMOTE, paired_gate

    golden, production, _ = _gate_inputs()
    out = paired_gate(golden, production, production, tolerance=0.02, n_boot=50)
    assert out["decision"] == PROMOTE and out["videos"] == len(golden) == 24
    assert set(out["intervals"]) == set(GATED)
    assert all(i["low"] == i["high"] == i["difference"] == 0 for i in out["intervals"].values())


def test_the_gate_rejects_a_challenger_that_flips_labelled_clips():
    from video_assets.core.evaluation.gate import REJECT, paired_gate

    flips = {"sam2_01_dog.mp4", "sam2_02_cups.mp4", "bottle-detection.mp4"}
    golden, production, challenger = _gate_inputs(flips)
    out = paired_gate(golden, production, challenger, tolerance=0.02, n_boot=50)
    assert out["decision"] == REJECT and "flagged_f1" in out["reason"]
    flagged = out["intervals"]["flagged_f1"]
    assert flagged["production"] == 1.0 and flagged["challenger"] < 1.0
    assert flagged["low"] <= flagged["difference"] <= flagged["high"] <= 0


def test_the_gate_weighs_the_noise_of_few_clips_and_refuses_to_decide_on_too_few():
    from video_assets.core.evaluation.gate import REJECT, UNDECIDED, paired_gate

    # One clip of 24 answered differently: flagged F1 drops 0.09, within a tolerance of 0.15 (a point
    # comparison would promote), but with 8 flagged clips the paired interval at 90% reaches a 0.33 drop.
    golden, production, challenger = _gate_inputs({"sam2_01_dog.mp4"})
    out = paired_gate(golden, production, challenger, tolerance=0.15, n_boot=200)
    flagged = out["intervals"]["flagged_f1"]
    assert -0.15 < flagged["difference"] < 0 and flagged["low"] < -0.15
    assert out["decision"] == REJECT and "flagged_f1" in out["reason"]
    # Three labelled clips: no decision, whatever they say (and the intervals are still recorded).
    out = paired_gate(golden[:3], production, production, tolerance=0.02, n_boot=20)
    assert out["decision"] == UNDECIDED and out["videos"] == 3 and "min_videos=10" in out["reason"]
    assert out["intervals"]
    nothing = paired_gate(golden, {}, production, tolerance=0.02, n_boot=20)
    assert nothing["decision"] == UNDECIDED and nothing["videos"] == 0


# -- the fact diff: what a challenger changes, video by video -----------------------------------------


def test_the_fact_diff_names_each_change_and_lists_flips_first():
    from video_assets.core.evaluation.diff import counts, fact_diff
    from video_assets.core.evaluation.metrics import Event

    def p(verdict, *spans):
        return {"verdict": verdict, "events": [Event(a, b, "lift", "cup") for a, b in spans], "answered": True}

    production = {
        "a": p("confirmed", (0, 2)),
        "b": p("none"),
        "c": p("confirmed", (0, 2)),
        "d": p("possible"),
        "e": p("confirmed", (0, 2)),
        "f": p("confirmed", (0, 2)),
        "g": p("suspected", (1, 3)),
    }
    challenger = {
        "a": p("none"),  # an alert vanishes
        "b": p("suspected", (4, 5)),  # an alert appears
        "c": p("suspected", (0, 2)),  # still flagged, another verdict
        "d": {"verdict": "unparsed", "events": [], "answered": False},  # no answer any more
        "e": p("confirmed", (5, 9)),  # the same verdict, the event moved
        "f": p("confirmed", (0.1, 2.1)),  # the same (IoU 0.9)
        # g: the challenger never answered this video
    }
    videos = [{"video_id": v, "uri": f"/v/{v}.mp4", "sample": "shadow" if v in "fg" else "golden"} for v in "abcdefg"]
    rows = fact_diff(videos, production, challenger)
    assert [(r["video_id"], r["change"]) for r in rows] == [
        ("a", "flag_lost"),
        ("b", "flag_gained"),
        ("c", "verdict_changed"),
        ("d", "unparsed_now"),
        ("g", "unparsed_now"),
        ("e", "events_changed"),
        ("f", "same"),
    ]
    assert counts(rows) == {
        "flag_lost": 1,
        "flag_gained": 1,
        "verdict_changed": 1,
        "unparsed_now": 2,
        "parsed_now": 0,
        "events_changed": 1,
        "same": 1,
    }
    b = rows[1]
    assert (b["production_verdict"], b["challenger_verdict"], b["start_s"], b["end_s"]) == ("none", "suspected", 4, 5)
    assert b["challenger_events"][0]["action"] == "lift" and b["production_events"] == []
