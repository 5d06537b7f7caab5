"""Golden labels: a versioned JSONL file per use case, validated and loaded into Delta."""

import hashlib
import json
from pathlib import Path

import polars as pl
from dagster import AssetExecutionContext, Failure, MaterializeResult, MetadataValue, asset
from pydantic import BaseModel, Field, ValidationError, model_validator

from resources.delta import DeltaTables
from video_assets.evaluation import VERDICTS
from video_assets.previews import table_metadata
from video_assets.tables import GOLDEN_SET, KEYS, SCHEMAS, column_schema, to_arrow
from video_assets.usecase import EventOut

USE_CASES = Path(__file__).parent / "usecases"


class GoldenEvent(EventOut):
    """An expected event: the model's event shape (same ordering rule), the actor optional."""

    actor: str = ""


class GoldenRecord(BaseModel):
    file: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    verdict: str
    events: list[GoldenEvent] = []
    reference_caption: str | None = None

    @model_validator(mode="after")
    def consistent(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict {self.verdict!r} is not one of {VERDICTS}")
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
        {"use_case": use_case, "labels_version": version, "file": r.file, "video_id": r.sha256,
         "verdict": r.verdict, "events": [e.model_dump() for e in r.events], "reference_caption": r.reference_caption}
        for r in records
    ]


@asset(
    group_name="evaluation",
    kinds={"delta"},
    owners=["team:video-platform"],
    code_version="1",
    metadata={"dagster/column_schema": column_schema(GOLDEN_SET)},
    description="Person-written labels of every use case (video_assets/usecases/<name>/golden.jsonl), "
    "matched to videos by content hash; the labels_version is the file's hash.",
)
def golden_set(context: AssetExecutionContext, tables: DeltaTables) -> MaterializeResult:
    rows, versions = [], {}
    for path in sorted(USE_CASES.glob("*/golden.jsonl")):
        use_case = path.parent.name
        try:
            records, version = load_labels(path)
        except ValueError as exc:
            raise Failure(str(exc)) from exc
        versions[use_case] = version
        rows += golden_rows(use_case, records, version)
        context.log.info(f"{use_case}: {len(records)} labelled videos, labels version {version}")
    # The table holds exactly the current labels: a removed record must not linger.
    for use_case in versions:
        tables.delete(GOLDEN_SET, f"use_case = '{use_case}'")
    tables.merge(GOLDEN_SET, to_arrow(GOLDEN_SET, rows), KEYS[GOLDEN_SET])
    out = tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET])
    return MaterializeResult(
        metadata={
            **table_metadata(tables.table_uri(GOLDEN_SET), out, out.height, ["use_case", "file", "verdict"]),
            "labels_versions": MetadataValue.json(versions),
            "verdict_counts": MetadataValue.json(
                dict(out.group_by("verdict").len().sort("verdict").iter_rows())
            ),
        }
    )
