"""The upload sensor against a real temporary Dagster instance and real Delta tables."""

import json
import os
import shutil

import polars as pl
from dagster import SensorResult, SkipReason, build_sensor_context

from resources.delta import DeltaTables
from resources.volume import VideoVolume
from tests.fixtures.samples import copy_samples
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.ingest.sensors import decode_cursor, upload_sensor
from video_assets.defs.partitions import video_batches

CLIPS = ["realshort.mp4", "asl_eat.mkv", "carphone_distorted.mp4"]  # all bundled: tests run without the corpus


def tick(instance, resources, cursor=None):
    ctx = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
    result = upload_sensor(ctx)
    if isinstance(result, SensorResult):
        for req in result.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


def test_new_files_make_one_batch_then_nothing(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    first = tick(instance, resources)
    assert isinstance(first, SensorResult)
    assert len(first.run_requests) == 1
    key = first.run_requests[0].partition_key
    assert first.run_requests[0].run_key == key
    assert instance.get_dynamic_partitions(video_batches.name) == [key]
    manifest = pl.read_delta(resources["tables"].table_uri("batch_manifest"))
    assert sorted(manifest.filter(pl.col("batch_key") == key)["uri"].str.split("/").list.last()) == sorted(CLIPS)
    # The manifest rows the tick wrote are reported as a batch_manifest materialisation (lineage).
    [event] = first.asset_events
    assert event.asset_key.to_user_string() == "batch_manifest"
    assert event.metadata["rows_written"].value == len(CLIPS) and event.metadata["batches"].value == [key]

    again = tick(instance, resources, cursor=first.cursor)
    assert isinstance(again, SkipReason)
    # Even without the cursor (e.g. reset), known files are not batched again.
    reset = tick(instance, resources, cursor=None)
    assert not getattr(reset, "run_requests", None)
    assert not getattr(reset, "asset_events", None)  # nothing written, nothing reported
    assert instance.get_dynamic_partitions(video_batches.name) == [key]


def test_renamed_copy_is_not_registered_twice(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    first = tick(instance, resources)
    shutil.copy(volume_dir / "realshort.mp4", volume_dir / "renamed_copy.mp4")
    second = tick(instance, resources, cursor=first.cursor)
    assert not getattr(second, "run_requests", None)
    assert len(instance.get_dynamic_partitions(video_batches.name)) == 1
    manifest = pl.read_delta(resources["tables"].table_uri("batch_manifest"))
    dup = manifest.filter(pl.col("uri").str.ends_with("renamed_copy.mp4"))
    assert dup["status"].to_list() == ["duplicate"]
    assert dup["duplicate_of"][0].endswith("realshort.mp4")


def test_a_second_upload_is_a_second_batch(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:1])
    first = tick(instance, resources)
    copy_samples(volume_dir, CLIPS[1:])
    second = tick(instance, resources, cursor=first.cursor)
    assert len(second.run_requests) == 1
    keys = instance.get_dynamic_partitions(video_batches.name)
    assert len(keys) == 2 and second.run_requests[0].partition_key != first.run_requests[0].partition_key


def test_batch_size_bounds_each_partition(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    resources = {**resources, "volume": VideoVolume(**{**resources["volume"].model_dump(), "batch_size": 2})}
    result = tick(instance, resources)
    assert len(result.run_requests) == 2


def test_a_crash_after_the_manifest_write_is_repaired(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    plan = register_new_files(resources["volume"], resources["tables"])  # manifest written, no partition
    result = tick(instance, resources)
    assert [r.partition_key for r in result.run_requests] == list(plan.batches)


# Table accesses made through the resource, by any instance (resources are copied when bound).
TABLE_CALLS: list[tuple[str, str]] = []


# The manifest reads, each with whether it was pushed down to some rows (a filter) or read the whole table.
MANIFEST_READS: list[str] = []


class CountingTables(DeltaTables):
    """The real Delta resource, recording every read (and log look-up) it is asked for."""

    def read(self, name, schema=None, where=None):
        TABLE_CALLS.append(("read", name))
        if name == "batch_manifest":
            MANIFEST_READS.append("whole" if where is None else "filtered")
        return super().read(name, schema, where)

    def batch(self, name, batch, schema=None):
        TABLE_CALLS.append(("batch", name))
        return super().batch(name, batch, schema)

    def row_count(self, name):
        TABLE_CALLS.append(("row_count", name))
        return super().row_count(name)

    def version(self, name):
        TABLE_CALLS.append(("version", name))
        return super().version(name)


def counting(resources):
    TABLE_CALLS.clear()
    MANIFEST_READS.clear()
    return {**resources, "tables": CountingTables(**resources["tables"].model_dump())}


def test_an_unchanged_tick_reads_no_table(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    resources = counting(resources)
    first = tick(instance, resources)
    assert len(first.run_requests) == 1
    assert ("read", "batch_manifest") in TABLE_CALLS  # a changed listing does read (the count works)
    TABLE_CALLS.clear()
    for _ in range(3):
        assert isinstance(tick(instance, resources, cursor=first.cursor), SkipReason)
    assert TABLE_CALLS == []


def test_a_crash_after_the_manifest_write_is_repaired_despite_a_cursor(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:1])
    first = tick(instance, resources)
    copy_samples(volume_dir, CLIPS[1:])
    # A tick that wrote the manifest and died: its cursor was never stored, the previous one stands.
    plan = register_new_files(resources["volume"], resources["tables"])
    repaired = tick(instance, resources, cursor=first.cursor)
    assert [r.partition_key for r in repaired.run_requests] == list(plan.batches)
    assert isinstance(tick(instance, resources, cursor=repaired.cursor), SkipReason)


def test_a_partition_lost_after_its_tick_is_requested_again(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS)
    first = tick(instance, resources)
    [key] = [r.partition_key for r in first.run_requests]
    instance.delete_dynamic_partition(video_batches.name, key)
    # The listing is unchanged, but the cursor names a batch the instance no longer has.
    again = tick(instance, resources, cursor=first.cursor)
    assert [r.partition_key for r in again.run_requests] == [key]
    assert instance.get_dynamic_partitions(video_batches.name) == [key]


def test_camera_segments_are_the_stream_sensors_with_priority(instance, resources, volume_dir):
    from video_assets.defs.ingest.sensors import STREAM_RUN_PRIORITY, stream_sensor

    copy_samples(volume_dir, ["realshort.mp4"])  # an upload
    copy_samples(volume_dir / "streams" / "dock", ["asl_eat.mkv", "carphone_distorted.mp4"])  # two segments
    streams = stream_sensor(build_sensor_context(instance=instance, resources=resources))
    for req in streams.dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    [run] = streams.run_requests
    assert run.tags["dagster/priority"] == STREAM_RUN_PRIORITY and run.tags["video/source"] == "stream"
    manifest = pl.read_delta(resources["tables"].table_uri("batch_manifest"))
    mine = manifest.filter(pl.col("batch_key") == run.partition_key)["uri"].to_list()
    assert len(mine) == 2 and all("/streams/dock/" in u for u in mine)
    # The upload sensor takes the upload only, at the archive's priority.
    [upload] = tick(instance, resources).run_requests
    assert "dagster/priority" not in upload.tags
    batch = pl.read_delta(resources["tables"].table_uri("batch_manifest")).filter(
        pl.col("batch_key") == upload.partition_key
    )
    assert [u.rsplit("/", 1)[1] for u in batch["uri"]] == ["realshort.mp4"]
    again = stream_sensor(build_sensor_context(instance=instance, resources=resources, cursor=streams.cursor))
    assert isinstance(again, SkipReason)


def test_a_tick_lists_only_the_folders_that_changed_and_reads_only_their_rows(instance, resources, volume_dir):
    """Issue 41: a tick's cost follows what changed, not the archive. A file lands in one folder of several: the
    walk lists that folder only (the others are stat'ed), and the manifest is read for its files only."""
    for day, clip in (("day1", CLIPS[0]), ("day2", CLIPS[1])):
        copy_samples(volume_dir / day, [clip])
    resources = counting(resources)
    first = tick(instance, resources)
    assert len(first.run_requests) == 1 and MANIFEST_READS == ["whole"]  # the first tick lists everything
    MANIFEST_READS.clear()
    copy_samples(volume_dir / "day2", [CLIPS[2]])
    root = resources["volume"].local_root()
    walk = resources["volume"].changed_listing(decode_cursor(first.cursor, root).folders, streams=False)
    assert walk.changed == [str(volume_dir / "day2")]  # day1 and the root: unchanged, not listed
    assert [f.uri.rsplit("/", 1)[1] for f in walk.listing.files] == sorted([CLIPS[1], CLIPS[2]])
    second = tick(instance, resources, cursor=first.cursor)
    [run] = second.run_requests
    batch = pl.read_delta(resources["tables"].table_uri("batch_manifest")).filter(
        pl.col("batch_key") == run.partition_key
    )
    assert batch["uri"].to_list() == [str(volume_dir / "day2" / CLIPS[2])]
    assert MANIFEST_READS and set(MANIFEST_READS) == {"filtered"}  # never the whole manifest
    # A copy of known bytes in another folder is a duplicate (its bytes looked up by id, not by a whole read).
    shutil.copy(volume_dir / "day1" / CLIPS[0], volume_dir / "day2" / "again.mp4")
    third = tick(instance, resources, cursor=second.cursor)
    assert not getattr(third, "run_requests", None)
    dup = pl.read_delta(resources["tables"].table_uri("batch_manifest")).filter(
        pl.col("uri").str.ends_with("again.mp4")
    )
    assert dup["status"].to_list() == ["duplicate"] and dup["duplicate_of"][0].endswith(f"day1/{CLIPS[0]}")
    assert set(MANIFEST_READS) == {"filtered"}


def test_a_file_rewritten_in_place_is_found_by_the_next_whole_listing(instance, resources, volume_dir):
    """Rewriting a file moves no folder's mtime, so the changed-folder ticks do not see it; the whole listing
    every full_listing_s does (here: the volume set to list everything on every tick)."""
    copy_samples(volume_dir / "day1", [CLIPS[0]])
    first = tick(instance, resources)
    target = volume_dir / "day1" / CLIPS[0]
    folder_mtime = (volume_dir / "day1").stat().st_mtime_ns
    with open(target, "r+b") as f:  # new bytes in place: same name, same folder
        f.seek(2000)
        f.write(b"\x00" * 16)
    os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 1_000_000_000))
    assert (volume_dir / "day1").stat().st_mtime_ns == folder_mtime
    assert isinstance(tick(instance, resources, cursor=first.cursor), SkipReason)
    every_tick = {**resources, "volume": VideoVolume(**{**resources["volume"].model_dump(), "full_listing_s": 0})}
    found = tick(instance, every_tick, cursor=first.cursor)
    [run] = found.run_requests
    batch = pl.read_delta(resources["tables"].table_uri("batch_manifest")).filter(
        pl.col("batch_key") == run.partition_key
    )
    assert batch["uri"].to_list() == [str(target)]


def test_a_cursor_from_before_the_folder_map_lists_everything_once(instance, resources, volume_dir):
    copy_samples(volume_dir, CLIPS[:1])
    first = tick(instance, resources)
    old = json.dumps({"digest": decode_cursor(first.cursor).digest, "batches": decode_cursor(first.cursor).batches})
    again = tick(instance, resources, cursor=old)  # the same listing: nothing to do, the new cursor stored
    assert isinstance(again, SensorResult) and not again.run_requests and again.skip_reason is not None
    assert decode_cursor(again.cursor, resources["volume"].local_root()).folders
    assert isinstance(tick(instance, resources, cursor=again.cursor), SkipReason)
