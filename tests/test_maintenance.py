"""Delta maintenance compacts the small files merges leave behind without changing the data."""

from datetime import UTC, datetime, timedelta

import polars as pl
from dagster import DagsterInstance, DefaultScheduleStatus
from dagster._utils.schedules import cron_string_iterator
from deltalake import DeltaTable

from resources.delta import DeltaTables
from video_assets.core.tables import RAW_VIDEOS, to_arrow
from video_assets.definitions import defs
from video_assets.defs.maintenance.jobs import table_maintenance


def test_maintenance_job_compacts_and_keeps_rows(tmp_path):
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
    before = pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id")
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 5

    result = table_maintenance.execute_in_process(
        instance=DagsterInstance.ephemeral(),
        resources={"tables": tables},
        run_config={"ops": {"maintain_tables": {"config": {"retention_hours": 0}}}},
    )
    assert result.success
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 1
    assert pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id").equals(before)
    report = {r["table"]: r for r in result.output_for_node("maintain_tables")}
    assert report[RAW_VIDEOS]["files_removed"] == 5 and report[RAW_VIDEOS]["vacuumed"] == 5
    assert report["captions"] == {"table": "captions", "skipped": "does not exist"}


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
