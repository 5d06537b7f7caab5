"""The golden set: validated, versioned, loaded into Delta and matched to the samples by content hash."""

import hashlib
import json

import polars as pl
import pytest
from dagster import AssetKey, materialize

from tests.conftest import SAMPLES
from video_assets.golden import USE_CASES, golden_set, load_labels

LABELS = USE_CASES / "object_handling" / "golden.jsonl"


def test_shipped_labels_are_valid_and_match_the_counts():
    records, version = load_labels(LABELS)
    assert len(records) == 24 and len(version) == 12
    counts = {v: sum(r.verdict == v for r in records) for v in ("confirmed", "suspected", "possible", "none")}
    assert counts == {"confirmed": 6, "suspected": 0, "possible": 1, "none": 17}


@pytest.mark.skipif(not (SAMPLES / "MANIFEST.csv").exists(), reason="sample corpus not present")
def test_labels_point_at_the_sample_bytes():
    records, _ = load_labels(LABELS)
    for r in records:
        assert hashlib.sha256((SAMPLES / r.file).read_bytes()).hexdigest() == r.sha256, r.file


def test_bad_labels_are_refused_with_the_line(tmp_path):
    bad = tmp_path / "golden.jsonl"
    good = json.loads(LABELS.read_text().splitlines()[0])
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "verdict": "maybe"}) + "\n")
    with pytest.raises(ValueError, match="golden.jsonl:2"):
        load_labels(bad)


def test_golden_set_asset_writes_delta(instance, resources):
    assert materialize([golden_set], instance=instance, resources=resources).success
    assert materialize([golden_set], instance=instance, resources=resources).success  # idempotent
    df = pl.read_delta(resources["tables"].table_uri("golden_set"))
    assert sorted(df["use_case"].unique()) == ["loss_prevention", "object_handling"]
    df = df.filter(pl.col("use_case") == "object_handling")
    assert df.height == 24 and df["video_id"].n_unique() == 24
    bottle = df.filter(pl.col("file") == "bottle-detection.mp4")
    assert bottle["verdict"][0] == "confirmed" and len(bottle["events"][0]) >= 2
    mat = instance.get_latest_materialization_event(AssetKey("golden_set")).asset_materialization
    assert mat.metadata["verdict_counts"].value["none"] == 17 + 24  # loss_prevention's are all none
