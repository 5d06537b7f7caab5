"""Delta maintenance compacts the small files merges leave behind without changing the data."""

import polars as pl
from dagster import DagsterInstance
from deltalake import DeltaTable

from resources.delta import DeltaTables
from video_assets.definitions import defs
from video_assets.schedules import table_maintenance
from video_assets.tables import RAW_VIDEOS, to_arrow


def test_maintenance_job_compacts_and_keeps_rows(tmp_path):
    from datetime import datetime, timezone

    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    now = datetime.now(timezone.utc)
    for i in range(5):  # five merges: five small files
        row = {"video_id": f"v{i}", "uri": f"/v/{i}.mp4", "size_bytes": i, "mtime": now, "batch_key": "b", "registered_at": now}
        tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, [row]), ["video_id"])
    before = pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id")
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 5

    result = table_maintenance.execute_in_process(
        instance=DagsterInstance.ephemeral(), resources={"tables": tables},
        run_config={"ops": {"maintain_tables": {"config": {"retention_hours": 0}}}},
    )
    assert result.success
    assert len(DeltaTable(tables.table_uri(RAW_VIDEOS)).file_uris()) == 1
    assert pl.read_delta(tables.table_uri(RAW_VIDEOS)).sort("video_id").equals(before)
    report = {r["table"]: r for r in result.output_for_node("maintain_tables")}
    assert report[RAW_VIDEOS]["files_removed"] == 5 and report[RAW_VIDEOS]["vacuumed"] == 5
    assert report["captions"] == {"table": "captions", "skipped": "does not exist"}


def test_schedule_is_registered_and_stopped_by_default():
    schedule = defs.resolve_schedule_def("table_maintenance_schedule")
    assert schedule.cron_schedule == "0 3 * * *"
    assert schedule.default_status.value == "STOPPED"
