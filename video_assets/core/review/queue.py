"""The review queue as a person works it: ranked, each item with what the model said and where to look.
Pure (polars in, dicts out): the service reads the tables and hands them here.

Order: rows with a confidence, lowest first (the model was unsure); then rows the challenger answers
differently (``candidate_events``: the same segment and use case, another verdict), and the flips of the
latest promotion's fact diff (``promotion_diffs``: a whole video, ``segment`` -1); then unparsed rows (the
model could not answer); then the rest (verdict-only retries). Items a person already confirmed or corrected
are left out; items skipped go to the end.
"""

from __future__ import annotations

import hashlib

import polars as pl

# The key of a review_queue row (the structuring key): one item each.
ITEM_KEY = ("video_id", "segment", "use_case", "model_version", "prompt_version", "use_case_version", "structurer")
LOW_CONFIDENCE, DISAGREES, UNPARSED, OTHER = 0, 1, 2, 3
TIERS = {LOW_CONFIDENCE: "low confidence", DISAGREES: "challenger disagrees", UNPARSED: "unparsed", OTHER: "other"}


def item_id(row: dict) -> str:
    """A stable id of a review_queue row: its key's hash (16 hex)."""
    return hashlib.sha256("\x1f".join(str(row[k]) for k in ITEM_KEY).encode()).hexdigest()[:16]


def _flip_rows(diffs: pl.DataFrame | None, use_case: str) -> list[dict]:
    """The latest fact diff's flips of ``use_case`` as queue-shaped rows (a whole video: segment -1)."""
    from video_assets.core.evaluation.diff import FLIPS

    if diffs is None or diffs.is_empty():
        return []
    mine = diffs.filter(pl.col("use_case") == use_case)
    if mine.is_empty():
        return []
    latest = mine.sort("diffed_at").get_column("decision_id")[-1]
    rows = []
    for d in mine.filter((pl.col("decision_id") == latest) & pl.col("change").is_in(sorted(FLIPS))).to_dicts():
        verdict = d["production_verdict"] if d["production_verdict"] != "unparsed" else None
        rows.append(
            {k: d[k] for k in ("video_id", "use_case", "model_version", "prompt_version", "use_case_version", "uri")}
            | {"segment": -1, "structurer": d["structurer"], "verdict": verdict, "confidence": None}
            | {"events": d["production_events"], "start_s": d["start_s"], "end_s": d["end_s"]}
            | {
                "reason": f"challenger flips the video: {d['change']} (production {d['production_verdict']}, "
                f"challenger {d['challenger_verdict']})"
            }  # fmt: skip
            | {"excerpt": None, "batch_key": None, "_challenger": d["challenger_verdict"]}
        )
    return rows


def ranked(
    queue: pl.DataFrame,
    use_case: str,
    labels: pl.DataFrame | None = None,
    challenger: pl.DataFrame | None = None,
    diffs: pl.DataFrame | None = None,
) -> list[dict]:
    """The ``use_case``'s review_queue rows as items, in review order (see the module doc). ``labels``:
    review_labels rows; ``challenger``: candidate_events rows of the challenger (any versions); ``diffs``:
    promotion_diffs rows."""
    rows = [] if queue.is_empty() else queue.filter(pl.col("use_case") == use_case).to_dicts()
    rows += _flip_rows(diffs, use_case)
    if not rows:
        return []
    decided: dict[str, str] = {}
    if labels is not None and not labels.is_empty():
        for r in labels.filter(pl.col("use_case") == use_case).sort("labelled_at").to_dicts():
            decided[r["item_id"]] = r["decision"]
    other: dict[tuple, set] = {}
    if challenger is not None and not challenger.is_empty():
        for r in challenger.filter(pl.col("use_case") == use_case).select("video_id", "segment", "verdict").to_dicts():
            other.setdefault((r["video_id"], r["segment"]), set()).add(r["verdict"])
    items = []
    for r in rows:
        iid = item_id(r)
        if decided.get(iid) in ("confirmed", "corrected"):
            continue
        theirs = other.get((r["video_id"], r["segment"]), set()) - {r["verdict"]}
        if "_challenger" in r:  # a flip of the fact diff
            theirs, tier = {r["_challenger"]}, DISAGREES
        elif r.get("verdict") is None:
            tier = UNPARSED
        elif r.get("confidence") is not None:
            tier = LOW_CONFIDENCE
        elif theirs:
            tier = DISAGREES
        else:
            tier = OTHER
        items.append(
            {
                "item_id": iid,
                **{k: r[k] for k in ITEM_KEY},
                "uri": r.get("uri"),
                "batch_key": r.get("batch_key"),
                "tier": TIERS[tier],
                "reason": r.get("reason"),
                "verdict": r.get("verdict"),
                "confidence": r.get("confidence"),
                "events": list(r.get("events") or []),
                "start_s": r.get("start_s"),
                "end_s": r.get("end_s"),
                "excerpt": r.get("excerpt"),
                "challenger_verdicts": sorted(v for v in theirs if v is not None),
                "skipped": decided.get(iid) == "skipped",
                "_order": (
                    decided.get(iid) == "skipped",
                    tier,
                    r.get("confidence") or 0.0,
                    r["video_id"],
                    r["segment"],
                ),
            }
        )
    items.sort(key=lambda i: i["_order"])
    for i in items:
        del i["_order"]
    return items
