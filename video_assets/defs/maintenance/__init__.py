"""Maintenance: nightly compaction and vacuum of every Delta table."""

from dagster import Definitions

from video_assets.defs.maintenance.jobs import table_maintenance
from video_assets.defs.maintenance.schedules import table_maintenance_schedule

defs = Definitions(jobs=[table_maintenance], schedules=[table_maintenance_schedule])
