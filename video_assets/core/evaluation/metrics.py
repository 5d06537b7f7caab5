"""Scoring predicted verdicts and events against a golden set. Pure functions, no Dagster."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from video_assets.core.vocabulary import ANSWERED, FLAGGED, SEVERITY, UNPARSED, VERDICTS


@dataclass(frozen=True)
class Event:
    start_s: float
    end_s: float
    action: str = ""
    object: str = ""


def prf(tp: int, fp: int, fn: int) -> dict[str, float]:
    """Precision, recall, F1; 1.0 where there was nothing to find and nothing was claimed."""
    precision = tp / (tp + fp) if tp + fp else (1.0 if fn == 0 else 0.0)
    recall = tp / (tp + fn) if tp + fn else (1.0 if fp == 0 else 0.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}


def confusion_matrix(
    expected: Sequence[str], predicted: Sequence[str], labels: Sequence[str] = VERDICTS
) -> list[list[int]]:
    """Rows: expected label; columns: predicted label (an unknown prediction counts in no column)."""
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for e, p in zip(expected, predicted, strict=True):
        if e in index and p in index:
            matrix[index[e]][index[p]] += 1
    return matrix


def per_class(expected: Sequence[str], predicted: Sequence[str], labels: Sequence[str] = VERDICTS) -> dict[str, dict]:
    out = {}
    for label in labels:
        tp = sum(e == label and p == label for e, p in zip(expected, predicted))
        fp = sum(e != label and p == label for e, p in zip(expected, predicted))
        fn = sum(e == label and p != label for e, p in zip(expected, predicted))
        out[label] = prf(tp, fp, fn)
    return out


def flagged_scores(expected: Sequence[str], predicted: Sequence[str]) -> dict[str, float]:
    """The binary decision a dashboard acts on: confirmed or suspected."""
    tp = sum(e in FLAGGED and p in FLAGGED for e, p in zip(expected, predicted))
    fp = sum(e not in FLAGGED and p in FLAGGED for e, p in zip(expected, predicted))
    fn = sum(e in FLAGGED and p not in FLAGGED for e, p in zip(expected, predicted))
    return prf(tp, fp, fn)


def temporal_iou(a: Event, b: Event) -> float:
    inter = max(0.0, min(a.end_s, b.end_s) - max(a.start_s, b.start_s))
    union = max(a.end_s, b.end_s) - min(a.start_s, b.start_s)
    if union <= 0:  # two instants: equal or not
        return 1.0 if a.start_s == b.start_s else 0.0
    return inter / union


def match_events(
    expected: Sequence[Event], predicted: Sequence[Event], iou_threshold: float = 0.3
) -> tuple[int, int, int, list[float]]:
    """Greedy one-to-one matching by IoU (highest first). Returns tp, fp, fn and matched IoUs."""
    pairs = sorted(
        ((temporal_iou(e, p), i, j) for i, e in enumerate(expected) for j, p in enumerate(predicted)),
        reverse=True,
    )
    used_e, used_p, ious = set(), set(), []
    for iou, i, j in pairs:
        if iou < iou_threshold or iou == 0:
            break
        if i in used_e or j in used_p:
            continue
        used_e.add(i)
        used_p.add(j)
        ious.append(iou)
    tp = len(ious)
    return tp, len(predicted) - tp, len(expected) - tp, ious


def event_scores(
    expected: Mapping[str, Sequence[Event]], predicted: Mapping[str, Sequence[Event]], iou_threshold: float = 0.3
) -> dict[str, float]:
    """Events pooled over videos; a video missing from ``predicted`` has no predicted events."""
    tp = fp = fn = 0
    ious: list[float] = []
    for vid in set(expected) | set(predicted):
        t, f, n, i = match_events(expected.get(vid, []), predicted.get(vid, []), iou_threshold)
        tp, fp, fn = tp + t, fp + f, fn + n
        ious += i
    scores = prf(tp, fp, fn)
    scores["mean_iou"] = sum(ious) / len(ious) if ious else 0.0
    return scores


def bootstrap_ci(
    expected: Sequence[str],
    predicted: Sequence[str],
    metric=lambda e, p: flagged_scores(e, p)["f1"],
    n: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap over videos of any metric of (expected, predicted)."""
    if not expected:
        return (0.0, 0.0)
    rng = random.Random(seed)
    idx = range(len(expected))
    samples = []
    for _ in range(n):
        pick = [rng.choice(idx) for _ in idx]
        samples.append(metric([expected[i] for i in pick], [predicted[i] for i in pick]))
    samples.sort()
    lo = samples[int(alpha / 2 * (n - 1))]
    hi = samples[int((1 - alpha / 2) * (n - 1))]
    return (lo, hi)


def coverage(statuses: Iterable[str]) -> dict[str, float]:
    statuses = list(statuses)
    unparsed = sum(s == "unparsed" for s in statuses)
    return {"rows": len(statuses), "unparsed": unparsed, "unparsed_rate": unparsed / len(statuses) if statuses else 0.0}


# -- one use case, one candidate: from table rows to every score ------------------------------------


def video_predictions(rows: Iterable[Mapping]) -> dict[str, dict]:
    """Segment rows (structured_events dicts) -> one prediction per video: the most severe verdict of
    its answered segments, all their events; ``unparsed`` when no segment was answered."""
    out: dict[str, dict] = {}
    for r in rows:
        p = out.setdefault(r["video_id"], {"verdict": UNPARSED, "events": [], "answered": False})
        if r.get("status") in ANSWERED and r.get("verdict") in SEVERITY:
            if not p["answered"] or SEVERITY[r["verdict"]] > SEVERITY[p["verdict"]]:
                p["verdict"] = r["verdict"]
            p["answered"] = True
            p["events"] += [
                Event(e["start_s"], e["end_s"], e.get("action", ""), e.get("object", "")) for e in r.get("events") or []
            ]
    return out


def score_use_case(
    golden: Sequence[Mapping], predictions: Mapping[str, dict], iou_threshold: float = 0.3, n_boot: int = 1000
) -> dict:
    """Every score of one candidate on one golden set. Golden videos without a prediction (never
    registered or never structured) are left out and counted in ``missing``."""
    scored = [g for g in golden if g["video_id"] in predictions]
    expected = [g["verdict"] for g in scored]
    predicted = [predictions[g["video_id"]]["verdict"] for g in scored]
    flagged = flagged_scores(expected, predicted)
    classes = per_class(expected, predicted)
    lo, hi = bootstrap_ci(expected, predicted, n=n_boot)
    ev = event_scores(
        {
            g["video_id"]: [
                Event(e["start_s"], e["end_s"], e.get("action", ""), e.get("object", "")) for e in g.get("events") or []
            ]
            for g in scored
        },
        {g["video_id"]: predictions[g["video_id"]]["events"] for g in scored},
        iou_threshold,
    )
    answered = sum(p != UNPARSED for p in predicted)
    metrics = {
        "flagged_precision": flagged["precision"],
        "flagged_recall": flagged["recall"],
        "flagged_f1": flagged["f1"],
        "flagged_f1_ci_low": lo,
        "flagged_f1_ci_high": hi,
        "macro_f1": sum(c["f1"] for c in classes.values()) / len(classes),
        "accuracy": sum(e == p for e, p in zip(expected, predicted)) / len(scored) if scored else 0.0,
        "event_precision": ev["precision"],
        "event_recall": ev["recall"],
        "event_f1": ev["f1"],
        "mean_iou": ev["mean_iou"],
        "coverage": answered / len(scored) if scored else 0.0,
        "unparsed_rate": 1 - answered / len(scored) if scored else 0.0,
    }
    metrics.update({f"{label}_{k}": v for label, c in classes.items() for k, v in c.items() if k != "support"})
    return {
        "metrics": metrics,
        "per_class": classes,
        "confusion": {
            "rows": list(VERDICTS),
            "columns": [*VERDICTS, UNPARSED],
            "matrix": confusion_matrix(expected, predicted, labels=(*VERDICTS, UNPARSED))[: len(VERDICTS)],
        },
        "golden_videos": len(golden),
        "scored_videos": len(scored),
        "missing": sorted(g.get("file", g["video_id"]) for g in golden if g["video_id"] not in predictions),
    }
