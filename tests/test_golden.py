"""The golden set: validated, versioned, loaded into Delta and matched to the samples by content hash."""

import hashlib
import json

import polars as pl
import pytest
from dagster import AssetKey, materialize

from tests.fixtures.samples import HAVE_CORPUS, find
from video_assets.core.evaluation.golden import label_files, load_labels
from video_assets.core.media.probe import probe
from video_assets.core.structuring.usecase import USE_CASES_DIR as USE_CASES
from video_assets.core.vocabulary import VERDICTS
from video_assets.defs.evaluation.assets import golden_set

LABELS = USE_CASES / "object_handling" / "golden.jsonl"
USE_CASE_LABELS = label_files()
LABEL_GRANULARITY_S = 0.1  # labels give times to a tenth of a second, rounded to the nearest


@pytest.mark.parametrize("use_case", sorted(USE_CASE_LABELS))
def test_shipped_labels_are_valid_and_consistent(use_case):
    records, version = load_labels(USE_CASE_LABELS[use_case])
    assert records, f"{use_case} has no labels"
    assert len({r.file for r in records}) == len(records), "a file is labelled twice"
    assert len({r.sha256 for r in records}) == len(records), "two labels point at the same bytes"
    for r in records:
        assert r.verdict in VERDICTS, r.file
        for e in r.events:
            assert 0 <= e.start_s <= e.end_s, r.file


@pytest.mark.parametrize("use_case", sorted(USE_CASE_LABELS))
def test_labels_point_at_sample_bytes_and_events_lie_inside_the_clip(use_case):
    records, _ = load_labels(USE_CASE_LABELS[use_case])
    checked = 0
    for r in records:
        path = find(r.file)
        if path is None:  # in the corpus only, and the corpus is absent
            assert not HAVE_CORPUS, f"{r.file} is labelled but not in the corpus"
            continue
        assert hashlib.sha256(path.read_bytes()).hexdigest() == r.sha256, r.file
        if r.events:
            result = probe(str(path))
            assert result.ok, (r.file, result.error)
            assert max(e.end_s for e in r.events) <= result.duration_s + LABEL_GRANULARITY_S, r.file
        checked += 1
    assert checked, f"none of {use_case}'s labelled clips is bundled or in the corpus"


def test_bad_labels_are_refused_with_the_line(tmp_path):
    bad = tmp_path / "golden.jsonl"
    good = json.loads(LABELS.read_text().splitlines()[0])
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "verdict": "maybe"}) + "\n")
    with pytest.raises(ValueError, match="golden.jsonl:2"):
        load_labels(bad)


def test_the_version_changes_with_the_bytes(tmp_path):
    _, version = load_labels(LABELS)
    copy = tmp_path / "golden.jsonl"
    copy.write_bytes(LABELS.read_bytes())
    assert load_labels(copy)[1] == version
    copy.write_bytes(LABELS.read_bytes() + b"\n")  # the same records, other bytes: a new version
    assert load_labels(copy)[1] != version


def test_golden_set_asset_writes_delta(instance, resources):
    assert materialize([golden_set], instance=instance, resources=resources).success
    assert materialize([golden_set], instance=instance, resources=resources).success  # idempotent
    df = pl.read_delta(resources["tables"].table_uri("golden_set"))
    assert sorted(df["use_case"].unique()) == sorted(USE_CASE_LABELS)
    expected_counts: dict[str, int] = {}
    for use_case, path in USE_CASE_LABELS.items():
        records, version = load_labels(path)
        rows = df.filter(pl.col("use_case") == use_case)
        # Exactly the file's records, once each, keyed by content hash, with the file's version.
        assert rows.height == len(records) and set(rows["labels_version"]) == {version}
        by_id = {row["video_id"]: row for row in rows.to_dicts()}
        assert set(by_id) == {r.sha256 for r in records}
        for r in records:
            row = by_id[r.sha256]
            assert (row["file"], row["verdict"]) == (r.file, r.verdict)
            assert [(e["start_s"], e["end_s"]) for e in row["events"]] == [(e.start_s, e.end_s) for e in r.events]
            expected_counts[r.verdict] = expected_counts.get(r.verdict, 0) + 1
    mat = instance.get_latest_materialization_event(AssetKey("golden_set")).asset_materialization
    assert mat.metadata["verdict_counts"].value == expected_counts


def test_a_stored_review_label_outside_its_clip_never_replaces_the_shipped_one(instance, resources):
    """Issue 44: a label with events at 5,000-80,000 s on a 4 s clip replaced the shipped golden label. One
    saved before the service checked times is left out of golden_set (its video's duration from
    video_metadata); a label inside the clip still replaces the shipped one."""
    from datetime import UTC, datetime

    from tests.fixtures.samples import clip
    from video_assets.core.review.labels import label_input, label_row
    from video_assets.core.structuring.usecase import load
    from video_assets.core.tables import REVIEW_LABELS, VIDEO_METADATA, to_arrow

    tables, now = resources["tables"], datetime.now(UTC)
    records, _ = load_labels(LABELS)
    shipped = {r.file: r for r in records}
    short, other = shipped["carphone_distorted.mp4"], shipped["chaplin.mp4"]  # 4.0 s and 9.6 s, both "none"
    meta = [
        probe(str(clip(r.file))).as_row() | {"video_id": r.sha256, "batch_key": "b1", "uri": r.file, "probed_at": now}
        for r in (short, other)
    ]
    tables.merge(VIDEO_METADATA, to_arrow(VIDEO_METADATA, meta), ["video_id"])
    event = {"actor": "person", "action": "lift", "object": "kettle"}
    labels = []
    for r, start, end, label_id in ((short, 5000.0, 80000.0, "forged-01"), (other, 1.0, 2.0, "fits-001")):
        item = {"item_id": "0" * 16, "video_id": r.sha256, "segment": 0, "use_case": "object_handling"}
        item |= {"model_version": "1", "prompt_version": 1, "use_case_version": "u1", "structurer": "s"}
        body = {"label_id": label_id, "item_id": item["item_id"], "action": "save", "reviewer": "eve"}
        body |= {"verdict": "confirmed", "events": [{"start_s": start, "end_s": end, **event}]}
        labels.append(label_row(item | {"uri": r.file}, label_input(load("object_handling")).model_validate(body), now))
    tables.merge(REVIEW_LABELS, to_arrow(REVIEW_LABELS, labels), ["label_id"])
    assert materialize([golden_set], instance=instance, resources=resources).success
    rows = {r["file"]: r for r in pl.read_delta(tables.table_uri("golden_set")).to_dicts()}
    kept = rows["carphone_distorted.mp4"]
    assert (kept["source"], kept["verdict"], kept["events"]) == ("shipped", "none", [])
    fits = rows["chaplin.mp4"]
    assert (fits["source"], fits["verdict"], fits["label_id"]) == ("reviewed", "confirmed", "fits-001")
