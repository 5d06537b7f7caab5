"""Golden labels: a versioned JSONL file per use case (``usecases/<name>/golden.jsonl``), validated. Pure."""

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, model_validator

from video_assets.core.structuring.usecase import USE_CASES_DIR, EventOut
from video_assets.core.vocabulary import Verdict


class GoldenEvent(EventOut):
    """An expected event: the model's event shape (same ordering rule), the actor optional."""

    actor: str = ""


class GoldenRecord(BaseModel):
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    verdict: Verdict
    events: list[GoldenEvent] = []
    reference_caption: str | None = None

    @model_validator(mode="after")
    def consistent(self):
        if self.verdict == "none" and self.events:
            raise ValueError("verdict none with events")
        return self


def load_labels(path: Path) -> tuple[list[GoldenRecord], str]:
    """Parse and validate a labels file; the version is the sha256 prefix of its bytes."""
    data = path.read_bytes()
    records, errors = [], []
    for n, line in enumerate(data.decode().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(GoldenRecord.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as exc:
            errors.append(f"{path.name}:{n}: {exc}")
    if errors:
        raise ValueError("invalid golden labels:\n" + "\n".join(errors[:20]))
    return records, hashlib.sha256(data).hexdigest()[:12]


def golden_rows(use_case: str, records: list[GoldenRecord], version: str) -> list[dict]:
    return [
        {
            "use_case": use_case,
            "labels_version": version,
            "file": r.file,
            "video_id": r.sha256,
            "verdict": r.verdict,
            "events": [e.model_dump() for e in r.events],
            "reference_caption": r.reference_caption,
        }
        for r in records
    ]


def label_files(root: Path = USE_CASES_DIR) -> dict[str, Path]:
    """use case name -> its labels file."""
    return {p.parent.name: p for p in sorted(root.glob("*/golden.jsonl"))}
