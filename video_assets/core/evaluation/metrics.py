"""Scoring predicted verdicts and events against a golden set. Pure functions, no Dagster.

Label scores come from scikit-learn (``precision_recall_fscore_support``, ``confusion_matrix``) and the
interval from SciPy (``scipy.stats.bootstrap``); this module adds its zero-division convention and the
event matching, which sklearn has no notion of.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from video_assets.core.vocabulary import ANSWERED, FLAGGED, SEVERITY, UNPARSED, VERDICTS


@dataclass(frozen=True)
class Event:
    start_s: float
    end_s: float
    action: str = ""
    object: str = ""


def prf(tp: int, fp: int, fn: int) -> dict[str, float]:
    """Precision, recall, F1 from counts (the event matching's); 1.0 where there was nothing to find
    and nothing was claimed. ``_label_scores`` gives labels the same convention."""
    precision = tp / (tp + fp) if tp + fp else (1.0 if fn == 0 else 0.0)
    recall = tp / (tp + fn) if tp + fn else (1.0 if fp == 0 else 0.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}


def _label_scores(expected: Sequence, predicted: Sequence, labels: Sequence) -> list[dict[str, float]]:
    """scikit-learn's precision, recall and F1 of each label, under ``prf``'s convention for what sklearn
    leaves undefined (NaN): a precision with nothing claimed is 1.0 when there was nothing to find, else
    0.0; a recall with nothing to find is 1.0 when nothing was claimed, else 0.0; an F1 with neither, 1.0."""
    from sklearn.metrics import precision_recall_fscore_support

    if len(expected) == 0:  # sklearn refuses empty inputs
        return [prf(0, 0, 0) for _ in labels]
    scores = precision_recall_fscore_support(
        expected, predicted, labels=list(labels), average=None, zero_division=np.nan
    )
    out = []
    for precision, recall, f1, support in zip(*scores):
        nothing_claimed, nothing_to_find = bool(np.isnan(precision)), support == 0
        out.append(
            {
                "precision": float(nothing_to_find) if nothing_claimed else float(precision),
                "recall": float(nothing_claimed) if nothing_to_find else float(recall),
                "f1": 1.0 if np.isnan(f1) else float(f1),
                "support": int(support),
            }
        )
    return out


def confusion_matrix(
    expected: Sequence[str], predicted: Sequence[str], labels: Sequence[str] = VERDICTS
) -> list[list[int]]:
    """Rows: expected label; columns: predicted label (a pair with a label outside ``labels`` counts
    in no cell)."""
    from sklearn.metrics import confusion_matrix as sk_confusion_matrix

    if len(expected) != len(predicted):
        raise ValueError(f"{len(expected)} expected labels but {len(predicted)} predicted")
    if not set(expected) & set(labels):  # sklearn refuses these (and empty inputs); no pair counts
        return [[0] * len(labels) for _ in labels]
    return sk_confusion_matrix(expected, predicted, labels=list(labels)).tolist()


def per_class(expected: Sequence[str], predicted: Sequence[str], labels: Sequence[str] = VERDICTS) -> dict[str, dict]:
    return dict(zip(labels, _label_scores(expected, predicted, labels)))


def flagged_scores(expected: Sequence[str], predicted: Sequence[str]) -> dict[str, float]:
    """The binary decision a dashboard acts on: confirmed or suspected."""
    return _label_scores([e in FLAGGED for e in expected], [p in FLAGGED for p in predicted], [True])[0]


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


def flagged_f1(expected: Sequence[str], predicted: Sequence[str]) -> float:
    return flagged_scores(expected, predicted)["f1"]


def _flagged_f1_resamples(flag_expected: np.ndarray, flag_predicted: np.ndarray, axis: int = -1) -> np.ndarray:
    """``flagged_f1`` of many resamples at once (scipy's vectorized statistic: one sklearn call per
    resample costs 40x more): 2tp / (2tp + fp + fn), 1.0 with nothing to find and nothing claimed."""
    tp = (flag_expected & flag_predicted).sum(axis=axis)
    wrong = (flag_expected != flag_predicted).sum(axis=axis)
    return np.where(2 * tp + wrong == 0, 1.0, 2 * tp / np.maximum(2 * tp + wrong, 1))


def bootstrap_ci(
    expected: Sequence[str],
    predicted: Sequence[str],
    metric=None,
    n: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap over videos (``scipy.stats.bootstrap``, pairs resampled together) of any
    metric of (expected, predicted); by default ``flagged_f1``."""
    if not expected:
        return (0.0, 0.0)
    if len(expected) == 1:  # scipy needs two observations; every resample of one is that one
        value = float((metric or flagged_f1)(list(expected), list(predicted)))
        return (value, value)
    from scipy.stats import bootstrap

    if metric is None or metric is flagged_f1:
        flags = [np.array([v in FLAGGED for v in values]) for values in (expected, predicted)]
        data, statistic, vectorized = tuple(flags), _flagged_f1_resamples, True
    else:
        data = (np.asarray(expected, dtype=object), np.asarray(predicted, dtype=object))
        statistic, vectorized = (lambda e, p: metric(list(e), list(p))), False
    result = bootstrap(
        data,
        statistic,
        paired=True,
        vectorized=vectorized,
        n_resamples=n,
        confidence_level=1 - alpha,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return (float(result.confidence_interval.low), float(result.confidence_interval.high))


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
    registered or never structured) are left out and counted in ``missing``. ``n_boot`` 0: no interval
    (NaN), for callers that resample themselves (``gate.paired_gate``)."""
    scored = [g for g in golden if g["video_id"] in predictions]
    expected = [g["verdict"] for g in scored]
    predicted = [predictions[g["video_id"]]["verdict"] for g in scored]
    flagged = flagged_scores(expected, predicted)
    classes = per_class(expected, predicted)
    lo, hi = bootstrap_ci(expected, predicted, n=n_boot) if n_boot else (float("nan"), float("nan"))
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
