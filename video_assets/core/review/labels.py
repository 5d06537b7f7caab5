"""A reviewer's decision as a label, and labels into the golden set. Pure.

A label is the person's answer for the whole video under one use case (its verdict, and its events in
seconds of the video), given while looking at one review_queue item. ``decision``: ``confirmed`` (the same
verdict and events the model gave), ``corrected`` (anything else) or ``skipped`` (no answer: the item moves
to the end of the queue). Every field is validated with the use case's own bounds (``usecase.output_model``);
event times must be JSON numbers (not strings or booleans) within the clip (``outside_clip``).

The golden set of a use case is its shipped labels (``golden.jsonl``) plus the reviewed ones: per video the
latest reviewed label wins over a shipped one (and says so: ``replaces_shipped``); labels of the same video
that disagree (another reviewer's latest, or the shipped label a review replaced) are listed in
``conflicts``, never merged silently. The labels version hashes the shipped file's version and every
reviewed label used, so a new label is a new version; without reviewed labels it is the file's own.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from video_assets.core.structuring.usecase import UseCase, output_model
from video_assets.core.vocabulary import Verdict

CONFIRMED, CORRECTED, SKIPPED = "confirmed", "corrected", "skipped"
SHIPPED, REVIEWED = "shipped", "reviewed"
EVENT_FIELDS = ("start_s", "end_s", "actor", "action", "object")
# An event may end this far past the clip's probed duration (a player's last frame and the container's
# duration differ by a frame or two); further is a typo or a forged time.
CLIP_TOLERANCE_S = 0.5


class _LabelIn(BaseModel):
    """What the review page sends for one item; ``label_input(uc)`` adds the use case's event bounds."""

    model_config = ConfigDict(extra="forbid")
    label_id: str = Field(pattern=r"^[A-Za-z0-9_-]{8,64}$", description="the page's id of this save")
    item_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    action: Literal["save", "skip"]
    verdict: Verdict | None = None
    events: list = []
    reviewer: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9 ._@-]+$")
    note: str | None = Field(default=None, max_length=500)

    @model_validator(mode="after")
    def consistent(self):
        if self.action == "skip":
            if self.verdict is not None or self.events:
                raise ValueError("a skip carries no verdict or events")
        elif self.verdict is None:
            raise ValueError("a save needs a verdict")
        elif self.verdict == "none" and self.events:
            raise ValueError("verdict none with events")
        return self


def label_input(uc: UseCase) -> type[_LabelIn]:
    """The request model of ``uc``: events of its own shape and bounds (text length, count, seconds)."""
    structured = output_model(uc)
    shaped = structured.model_fields["events"].annotation.__args__[0]
    # Strict: a time is a number; "5" or true would otherwise be coerced into one.
    seconds = (float, Field(ge=0, le=uc.max_seconds, strict=True, allow_inf_nan=False))
    event = create_model(f"{uc.name}_label_event", __base__=shaped, start_s=seconds, end_s=seconds)
    return create_model(
        f"{uc.name}_label",
        __base__=_LabelIn,
        events=(list[event], Field(default=[], max_length=uc.max_events)),
    )


def outside_clip(events, duration_s: float) -> str | None:
    """Why ``events`` (dicts or models with ``start_s``/``end_s``) do not fit a clip of ``duration_s``
    seconds, naming the first field that does not (``events[i].end_s``); None when they all do."""
    limit = duration_s + CLIP_TOLERANCE_S
    for i, e in enumerate(events or []):
        for name in ("start_s", "end_s"):
            t = e[name] if isinstance(e, dict) else getattr(e, name)
            if not math.isfinite(t) or not 0 <= t <= limit:
                return f"events[{i}].{name}: {t:g} s is outside the clip (0-{duration_s:g} s)"
    return None


def labels_outside_clips(labels: list[dict], durations: dict[str, float | None]) -> dict[str, str]:
    """label_id -> why, for the review_labels rows whose events do not fit their video's duration
    (``durations``: video_id -> seconds; a video of unknown duration is not judged)."""
    out = {}
    for r in labels:
        duration = durations.get(r["video_id"])
        if duration is not None and (why := outside_clip(r.get("events"), duration)):
            out[r["label_id"]] = why
    return out


def _events(events) -> list[dict]:
    return [{k: (float(e[k]) if k in ("start_s", "end_s") else e[k]) for k in EVENT_FIELDS} for e in events or []]


def label_row(item: dict, label: _LabelIn, now: datetime) -> dict:
    """The review_labels row of ``label`` given on ``item`` (a ``queue.ranked`` item)."""
    events = _events(e.model_dump() for e in label.events)
    model_events = _events(item.get("events"))
    if label.action == "skip":
        decision = SKIPPED
    elif label.verdict == item.get("verdict") and events == model_events:
        decision = CONFIRMED
    else:
        decision = CORRECTED
    keys = ("video_id", "segment", "use_case", "model_version", "prompt_version", "use_case_version", "structurer")
    return {
        "label_id": label.label_id,
        "item_id": item["item_id"],
        **{k: item[k] for k in keys},
        "uri": item.get("uri"),
        "model_verdict": item.get("verdict"),
        "model_confidence": item.get("confidence"),
        "model_events": model_events,
        "decision": decision,
        "verdict": label.verdict,
        "events": events,
        "reviewer": label.reviewer,
        "note": label.note,
        "labelled_at": now,
    }


def _answer(row: dict) -> tuple:
    return row["verdict"], tuple(tuple(e[k] for k in EVENT_FIELDS) for e in _events(row.get("events")))


def golden_with_reviews(use_case: str, shipped: list[dict], shipped_version: str, labels: list[dict]) -> list[dict]:
    """golden_set rows of ``use_case``: ``shipped`` (``golden.golden_rows``) with the reviewed ``labels``
    (review_labels rows, any use case, any decision) applied. Returns the rows, each with ``source``,
    ``replaces_shipped``, ``reviewed_by``, ``label_id``, ``conflicts`` and the new ``labels_version``."""
    answered = sorted(
        (r for r in labels if r["use_case"] == use_case and r["decision"] != SKIPPED),
        key=lambda r: (r["labelled_at"], r["label_id"]),
    )
    latest_by_reviewer: dict[str, dict[str, dict]] = {}
    for r in answered:
        latest_by_reviewer.setdefault(r["video_id"], {})[r["reviewer"]] = r
    # Without a reviewed label the version is the shipped file's own (scores stay comparable with before).
    version = shipped_version
    if latest_by_reviewer:
        used = [[r["label_id"], r["video_id"], *_answer(r)] for by in latest_by_reviewer.values() for r in by.values()]
        version = hashlib.sha256(json.dumps([shipped_version, used], sort_keys=True, default=str).encode()).hexdigest()[
            :12
        ]
    out: dict[str, dict] = {}
    for row in shipped:
        out[row["video_id"]] = {
            **row,
            "source": SHIPPED,
            "replaces_shipped": False,
            "reviewed_by": None,
            "label_id": None,
            "conflicts": None,
        }
    for video_id, by in latest_by_reviewer.items():
        label = max(by.values(), key=lambda r: (r["labelled_at"], r["label_id"]))
        others = [
            {"source": REVIEWED, "reviewer": r["reviewer"], "verdict": r["verdict"], "label_id": r["label_id"]}
            for r in by.values()
            if r is not label and _answer(r) != _answer(label)
        ]
        before = out.get(video_id)
        if before is not None and _answer(before) != _answer(label):
            others.append({"source": SHIPPED, "verdict": before["verdict"], "file": before["file"]})
        uri = label.get("uri") or ""
        out[video_id] = {
            "use_case": use_case,
            "file": before["file"] if before else PurePosixPath(uri).name or video_id,
            "video_id": video_id,
            "verdict": label["verdict"],
            "events": _events(label.get("events")),
            "reference_caption": before.get("reference_caption") if before else None,
            "source": REVIEWED,
            "replaces_shipped": before is not None,
            "reviewed_by": label["reviewer"],
            "label_id": label["label_id"],
            "conflicts": json.dumps(others) if others else None,
        }
    return [{**r, "labels_version": version} for _, r in sorted(out.items(), key=lambda kv: kv[1]["file"])]


def export_jsonl(rows: list[dict]) -> str:
    """golden_set rows as the use case's ``golden.jsonl`` lines (``file, sha256, verdict, events,
    reference_caption``): what a shipped labels file holds, to replace or extend it."""
    lines = []
    for r in rows:
        record = {"file": r["file"], "sha256": r["video_id"], "verdict": r["verdict"], "events": _events(r["events"])}
        record["reference_caption"] = r.get("reference_caption")
        lines.append(json.dumps(record, ensure_ascii=False))
    return "".join(line + "\n" for line in lines)
