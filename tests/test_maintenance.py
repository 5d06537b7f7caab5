"""Delta maintenance compacts the small files merges leave behind without changing the data, and
vacuums only files older than the retention floor unless told otherwise."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from dagster import DagsterInstance, DefaultScheduleStatus
from dagster._utils.schedules import cron_string_iterator
from deltalake import DeltaTable

from resources.delta import DeltaTables
from video_assets.core.tables import RAW_VIDEOS, to_arrow
from video_assets.definitions import defs
from video_assets.defs.maintenance.jobs import table_maintenance


def _five_small_files(tmp_path) -> DeltaTables:
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    now = datetime.now(UTC)
    for i in range(5):  # five merges: five small files
        row = {
            "video_id": f"v{i}",
            "uri": f"/v/{i}.mp4",
            "size_bytes": i,
            "mtime": now,
            "batch_key": "b",
            "registered_at": now,
        }
        tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, [row]), ["video_id"])
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 5
    return tables


def _run(tables: DeltaTables, **config):
    return table_maintenance.execute_in_process(
        instance=DagsterInstance.ephemeral(),
        resources={"tables": tables},
        run_config={"ops": {"maintain_tables": {"config": config}}},
        raise_on_error=False,
    )


def _files_on_disk(tables: DeltaTables) -> int:
    return len(list(Path(tables.table_uri(RAW_VIDEOS)).glob("*.parquet")))


def test_maintenance_job_compacts_and_keeps_rows(tmp_path):
    tables = _five_small_files(tmp_path)
    before = pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id")

    # A retention below the floor is for when nothing else writes: it must be asked for by name.
    result = _run(tables, retention_hours=0, allow_short_retention=True)
    assert result.success
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 1
    assert pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id").equals(before)
    report = {r["table"]: r for r in result.output_for_node("maintain_tables")}
    assert report[RAW_VIDEOS]["files_removed"] == 5 and report[RAW_VIDEOS]["vacuumed"] == 5
    assert report["captions"] == {"table": "captions", "skipped": "does not exist"}


def test_vacuum_keeps_recent_files_by_default(tmp_path):
    # The default (168 h) compacts but deletes none of the files a concurrent reader or writer may use.
    tables = _five_small_files(tmp_path)
    result = _run(tables)
    assert result.success
    report = {r["table"]: r for r in result.output_for_node("maintain_tables")}
    assert report[RAW_VIDEOS]["files_removed"] == 5 and report[RAW_VIDEOS]["vacuumed"] == 0
    assert _files_on_disk(tables) == 6  # five old (unreferenced, kept) + one compacted


@pytest.mark.parametrize("hours", [0, 167])
def test_a_retention_below_the_floor_is_refused_without_the_override(tmp_path, hours):
    tables = _five_small_files(tmp_path)
    version = tables.version(RAW_VIDEOS)
    result = _run(tables, retention_hours=hours)
    assert not result.success
    [failure] = result.get_step_failure_events()  # refused once, not retried
    message = failure.event_specific_data.error.message
    assert "168 h floor" in message and "allow_short_retention" in message
    # Refused before any table was touched: no compaction commit, every file still there.
    assert tables.version(RAW_VIDEOS) == version and _files_on_disk(tables) == 5
    with pytest.raises(ValueError, match="allow_short_retention"):
        tables.maintain(RAW_VIDEOS, retention_hours=hours)  # the resource refuses too, whoever calls it


def next_ticks(schedule, start: datetime, n: int) -> list[datetime]:
    ticks = cron_string_iterator(start.timestamp(), schedule.cron_schedule, schedule.execution_timezone or "UTC")
    return [next(ticks) for _ in range(n)]


def test_nightly_schedules_are_stopped_and_evaluation_follows_maintenance():
    maintenance = defs.resolve_schedule_def("table_maintenance_schedule")
    evaluation = defs.resolve_schedule_def("evaluation_schedule")
    # Both are switched on by an operator, and each runs its own job.
    for schedule, job in ((maintenance, table_maintenance), (evaluation, defs.resolve_job_def("evaluate"))):
        assert schedule.default_status == DefaultScheduleStatus.STOPPED, schedule.name
        assert schedule.job_name == job.name and defs.resolve_job_def(schedule.job_name)
    # From any moment (here a fixed one), each runs once a day, and every evaluation runs after
    # that night's maintenance and before the next: it scores freshly compacted tables.
    start = datetime(2026, 3, 28, 22, 30, tzinfo=UTC)
    m, e = next_ticks(maintenance, start, 4), next_ticks(evaluation, start, 4)
    for ticks in (m, e):
        assert all(b - a == timedelta(days=1) for a, b in zip(ticks, ticks[1:]))
    assert all(m[i] < e[i] < m[i] + timedelta(days=1) for i in range(4))


def test_a_key_repeated_across_batches_fails_the_maintenance_job_naming_the_table(tmp_path):
    """The asset checks cover one batch; the maintenance job checks each key across the whole table."""
    from deltalake import write_deltalake

    tables = _five_small_files(tmp_path)
    assert _run(tables).success
    now = datetime.now(UTC)
    again = {"video_id": "v1", "uri": "/v/1.mp4", "size_bytes": 1, "mtime": now, "batch_key": "c", "registered_at": now}
    write_deltalake(tables.table_uri(RAW_VIDEOS), to_arrow(RAW_VIDEOS, [again]), mode="append")  # a blind append
    assert tables.duplicate_keys(RAW_VIDEOS, ["video_id"]) == 1
    result = _run(tables)
    assert not result.success
    [failure] = result.get_step_failure_events()  # not retried: a rerun finds the same rows
    assert "raw_videos (1 keys, key video_id)" in failure.event_specific_data.error.message
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 1  # every table was still maintained
