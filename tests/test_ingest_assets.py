"""raw_videos + video_metadata materialised for a batch in a real instance; tables read back with polars."""

import os

import polars as pl
from dagster import AssetKey, AssetSelection, materialize

from tests.fixtures.samples import copy_samples
from video_assets.core.tables import RAW_VIDEOS, to_arrow
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.checks import ingest_checks
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.partitions import video_batches

CLIPS = ["realshort.mp4", "no_duration.webm", "fire2.mp4"]


def register(instance, resources) -> list[str]:
    plan = register_new_files(resources["volume"], resources["tables"])
    instance.add_dynamic_partitions(video_batches.name, list(plan.batches))
    return list(plan.batches)


def run(instance, resources, key):
    return materialize(
        [raw_videos, video_metadata, *ingest_checks], partition_key=key, instance=instance, resources=resources
    )


def test_batch_materialises_registry_and_probe(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    (volume_dir / "zero.mp4").write_bytes(b"")
    (volume_dir / "noise.mkv").write_bytes(os.urandom(50_000))
    [key] = register(instance, resources)

    result = run(instance, resources, key)
    assert result.success
    tables = resources["tables"]
    raw = pl.read_delta(tables.table_uri("raw_videos"))
    meta = pl.read_delta(tables.table_uri("video_metadata"))
    assert raw.height == 5 and meta.height == 5
    assert raw["video_id"].n_unique() == 5 and set(raw["batch_key"]) == {key}
    ok = dict(zip(meta["uri"].str.split("/").list.last(), meta["ok"]))
    assert ok == {
        "realshort.mp4": True,
        "no_duration.webm": True,
        "fire2.mp4": True,
        "zero.mp4": False,
        "noise.mkv": False,
    }
    reasons = dict(zip(meta["uri"].str.split("/").list.last(), meta["error"]))
    assert reasons["zero.mp4"] == "empty file (0 bytes)"
    assert "cannot open" in reasons["noise.mkv"]
    assert meta.filter(pl.col("uri").str.ends_with("fire2.mp4"))["rotation"][0] == -180

    mat = instance.get_latest_materialization_event(AssetKey("video_metadata")).asset_materialization
    assert mat.partition == key
    assert mat.metadata["dagster/row_count"].value == 5
    assert mat.metadata["dagster/uri"].value == tables.table_uri("video_metadata")
    assert "fire2.mp4" in mat.metadata["preview"].value
    checks = {(e.asset_key.to_user_string(), e.check_name): e for e in result.get_asset_check_evaluations()}
    # Every check ran; 2 of 5 unusable is above the default 25 % ceiling: reported as a warning, run still succeeds.
    assert {k: e.passed for k, e in checks.items()} == {
        **{(t, c): True for t in ("raw_videos", "video_metadata") for c in ("unique_key", "required_columns")},
        ("video_metadata", "video_metadata_not_ok_ratio"): False,
    }
    assert checks["video_metadata", "video_metadata_not_ok_ratio"].metadata["not_ok_ratio"].value == 0.4

    # Rerunning the batch changes nothing: same rows, same first registration time.
    before = raw.sort("video_id")
    assert run(instance, resources, key).success
    after = pl.read_delta(tables.table_uri("raw_videos")).sort("video_id")
    assert after.equals(before)
    assert pl.read_delta(tables.table_uri("video_metadata")).height == 5


def test_second_upload_touches_only_its_batch(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:1])
    [first] = register(instance, resources)
    assert run(instance, resources, first).success
    copy_samples(volume_dir, CLIPS[1:])
    (volume_dir / "copy.mp4").write_bytes((volume_dir / "realshort.mp4").read_bytes())
    [second] = register(instance, resources)
    assert run(instance, resources, second).success
    raw = pl.read_delta(resources["tables"].table_uri("raw_videos"))
    # (by key, not by key order: two batches registered within one second need not sort by time)
    assert dict(raw.group_by("batch_key").len().iter_rows()) == {first: 1, second: 2}
    assert not raw["uri"].str.ends_with("copy.mp4").any()


def test_a_file_removed_before_its_run_is_reported(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:2])
    [key] = register(instance, resources)
    (volume_dir / CLIPS[0]).unlink()
    result = run(instance, resources, key)
    assert result.success
    mat = instance.get_latest_materialization_event(AssetKey("raw_videos")).asset_materialization
    assert [u.rsplit("/", 1)[-1] for u in mat.metadata["missing_files"].value] == [CLIPS[0]]
    assert mat.metadata["dagster/row_count"].value == 1


def test_a_partition_without_manifest_fails_with_a_clear_message(instance, resources):
    instance.add_dynamic_partitions(video_batches.name, ["bogus"])
    result = materialize(
        [raw_videos], partition_key="bogus", instance=instance, resources=resources, raise_on_error=False
    )
    assert not result.success
    failure = result.get_step_failure_events()[0].event_specific_data.error.message
    assert "has no files in the manifest" in failure


def check_outcomes(result) -> dict[tuple[str, str], bool]:
    return {(e.asset_key.to_user_string(), e.check_name): e.passed for e in result.get_asset_check_evaluations()}


def test_the_key_check_fails_on_a_duplicate_key(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:2])
    [key] = register(instance, resources)
    assert check_outcomes(run(instance, resources, key))[("raw_videos", "unique_key")] is True
    tables = resources["tables"]
    raw = tables.read(RAW_VIDEOS)
    # A second row for an existing video_id under another uri (merged on uri, so Delta inserts it).
    twin = raw.head(1).with_columns(pl.lit("/elsewhere/twin.mp4").alias("uri"))
    tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, twin.to_dicts()), ["uri"])
    assert tables.read(RAW_VIDEOS).height == raw.height + 1

    # The checks alone, without a partition: they cover the latest materialised batch, which holds the twin.
    result = materialize(
        [raw_videos, video_metadata, *ingest_checks],
        selection=AssetSelection.checks(*ingest_checks),
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    outcomes = check_outcomes(result)
    assert outcomes[("raw_videos", "unique_key")] is False
    assert outcomes[("raw_videos", "required_columns")] is True
    assert outcomes[("video_metadata", "unique_key")] is True
    failed = next(
        e
        for e in result.get_asset_check_evaluations()
        if (e.asset_key.to_user_string(), e.check_name) == ("raw_videos", "unique_key")
    )
    assert failed.metadata["duplicate_keys"].value == [twin["video_id"][0]]


def test_the_checks_cover_only_the_batch_just_materialised(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:1])
    [first] = register(instance, resources)
    assert run(instance, resources, first).success
    copy_samples(volume_dir, CLIPS[1:2])
    [second] = register(instance, resources)
    assert run(instance, resources, second).success
    # A duplicate key planted in the first batch (a second row for its video under another uri).
    tables = resources["tables"]
    twin = tables.batch(RAW_VIDEOS, first).with_columns(pl.lit("/elsewhere/twin.mp4").alias("uri"))
    tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, twin.to_dicts()), ["uri"])

    def outcomes(result):
        return {(e.asset_key.to_user_string(), e.check_name): e for e in result.get_asset_check_evaluations()}

    # The second batch's run checks only its rows: the first batch's duplicate is not its to see.
    other = outcomes(run(instance, resources, second))[("raw_videos", "unique_key")]
    assert other.passed
    assert other.metadata["batches"].value == [second] and other.metadata["rows"].value == 1
    # Launched on their own (no partition), the checks cover the latest materialised batch: the second.
    alone = materialize(
        [raw_videos, video_metadata, *ingest_checks],
        selection=AssetSelection.checks(*ingest_checks),
        instance=instance,
        resources=resources,
    )
    assert outcomes(alone)[("raw_videos", "unique_key")].metadata["batches"].value == [second]
    # The first batch's run does see it (raw_videos and its checks: the twin would fail the probe's merge).
    rerun = materialize(
        [raw_videos, video_metadata, *ingest_checks],
        selection=AssetSelection.assets(raw_videos),
        partition_key=first,
        instance=instance,
        resources=resources,
    )
    own = outcomes(rerun)[("raw_videos", "unique_key")]
    assert not own.passed
    assert own.metadata["batches"].value == [first] and own.metadata["duplicate_keys"].value == [twin["video_id"][0]]
