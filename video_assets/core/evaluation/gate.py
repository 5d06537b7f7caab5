"""The promotion gate. Pure.

``paired_gate``: a paired bootstrap over the golden videos, the same resampled clips scored for production and challenger, so the interval of
each gated metric's difference (challenger - production) reflects what the clips themselves say, not two
independent noises. Promote only when, for every gated metric, the lower end of that interval at the
configured confidence is above ``-tolerance`` (no metric is worse than the tolerance with that confidence).
With fewer labelled videos scored by both than ``min_videos`` the gate does not decide: no promotion
unless forced (a single clip moves F1 by more than any useful tolerance at this size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from video_assets.core.evaluation.metrics import score_use_case

GATED = ("flagged_f1", "macro_f1", "event_f1", "coverage")
PROMOTE, REJECT, UNDECIDED = "promote", "reject", "undecided"


def _metrics(golden: Sequence[Mapping], predictions: Mapping[str, dict], iou: float, metrics) -> np.ndarray:
    scores = score_use_case(golden, predictions, iou, n_boot=0)["metrics"]
    return np.array([scores[m] for m in metrics], dtype=float)


def paired_gate(
    golden: Sequence[Mapping],
    production: Mapping[str, dict],
    challenger: Mapping[str, dict],
    tolerance: float,
    metrics: Sequence[str] = GATED,
    confidence: float = 0.9,
    n_boot: int = 1000,
    min_videos: int = 10,
    iou_threshold: float = 0.3,
    seed: int = 0,
) -> dict:
    """The decision on ``golden`` (golden_set rows) from both candidates' ``video_predictions``.

    Returns ``{"decision", "reason", "videos", "intervals"}``; ``intervals[m]`` holds the point difference
    (challenger - production), the two-sided interval at ``confidence`` and each side's point value."""
    metrics = list(metrics)
    both = [g for g in golden if g["video_id"] in production and g["video_id"] in challenger]
    out = {"videos": len(both), "confidence": confidence, "tolerance": tolerance, "intervals": {}}
    if not both:
        return out | {"decision": UNDECIDED, "reason": "undecided: no golden video was scored by both candidates"}
    prod_point = _metrics(both, production, iou_threshold, metrics)
    chal_point = _metrics(both, challenger, iou_threshold, metrics)
    rng = np.random.default_rng(seed)
    deltas = np.empty((n_boot, len(metrics)))
    for b in range(n_boot):
        # One resample of the clips, scored for both: a clip drawn twice counts twice (ids made distinct).
        draw = rng.integers(0, len(both), len(both))
        sample = [{**both[i], "video_id": f"{both[i]['video_id']}#{k}"} for k, i in enumerate(draw)]
        prod = {f"{both[i]['video_id']}#{k}": production[both[i]["video_id"]] for k, i in enumerate(draw)}
        chal = {f"{both[i]['video_id']}#{k}": challenger[both[i]["video_id"]] for k, i in enumerate(draw)}
        deltas[b] = _metrics(sample, chal, iou_threshold, metrics) - _metrics(sample, prod, iou_threshold, metrics)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(deltas, alpha, axis=0), np.quantile(deltas, 1 - alpha, axis=0)
    for j, m in enumerate(metrics):
        out["intervals"][m] = {
            "production": round(float(prod_point[j]), 4),
            "challenger": round(float(chal_point[j]), 4),
            "difference": round(float(chal_point[j] - prod_point[j]), 4),
            "low": round(float(lo[j]), 4),
            "high": round(float(hi[j]), 4),
        }
    lines = "; ".join(
        f"{m} {i['production']:.3f} -> {i['challenger']:.3f} (diff {i['difference']:+.3f}, "
        f"{confidence:.0%} interval [{i['low']:+.3f}, {i['high']:+.3f}])"
        for m, i in out["intervals"].items()
    )
    if len(both) < min_videos:
        return out | {
            "decision": UNDECIDED,
            "reason": f"undecided: {len(both)} golden videos scored by both, fewer than min_videos={min_videos} "
            f"({lines})",
        }
    worse = [m for m, i in out["intervals"].items() if i["low"] < -tolerance]
    if worse:
        return out | {
            "decision": REJECT,
            "reason": f"rejected: {', '.join(worse)} may be worse by more than {tolerance:g} at {confidence:.0%} "
            f"({lines})",
        }
    return out | {
        "decision": PROMOTE,
        "reason": f"promoted: no metric worse by more than {tolerance:g} at {confidence:.0%} ({lines})",
    }
