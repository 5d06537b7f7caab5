"""Delta table maintenance: compact, then vacuum with a retention that keeps time travel working."""

from dagster import Config, OpExecutionContext, job, op
from pydantic import Field

from resources.delta import DeltaTables
from video_assets.core.tables import SCHEMAS


class MaintenanceConfig(Config):
    retention_hours: int = Field(default=168, ge=0, description="Keep unreferenced files this long (time travel)")


@op(description="Compact and vacuum every table of the product.")
def maintain_tables(context: OpExecutionContext, config: MaintenanceConfig, tables: DeltaTables) -> list[dict]:
    results = []
    for name in SCHEMAS:
        result = tables.maintain(name, config.retention_hours)
        context.log.info(f"{name}: {result}")
        results.append(result)
    return results


@job(description="Delta maintenance for all tables; safe to run while batches run (delta-rs retries conflicts).")
def table_maintenance():
    maintain_tables()
