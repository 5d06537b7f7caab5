"""Delta table maintenance: compact, then vacuum with a retention that keeps time travel working; and a
whole-table unique-key check of every table."""

from dagster import Config, Failure, OpExecutionContext, job, op
from pydantic import Field

from resources.delta import MIN_RETENTION_HOURS, DeltaTables
from video_assets.core.tables import KEYS, SCHEMAS
from video_assets.defs.common import TRANSIENT_RETRY


class MaintenanceConfig(Config):
    retention_hours: int = Field(
        default=MIN_RETENTION_HOURS,
        ge=0,
        description=f"Keep unreferenced files this long (time travel); at least {MIN_RETENTION_HOURS} "
        "unless allow_short_retention",
    )
    allow_short_retention: bool = Field(
        default=False,
        description=f"Allow retention_hours below {MIN_RETENTION_HOURS}: only when no run writes the tables, "
        "as vacuum may otherwise delete files a running batch has written but not committed",
    )


# Compaction and vacuum are idempotent (a rerun finds less to do), so a transient storage error is retried.
@op(
    description="Compact and vacuum every table of the product, then check each table's key is unique across "
    "the whole table (the asset checks cover one batch).",
    retry_policy=TRANSIENT_RETRY,
)
def maintain_tables(context: OpExecutionContext, config: MaintenanceConfig, tables: DeltaTables) -> list[dict]:
    if config.retention_hours < MIN_RETENTION_HOURS and not config.allow_short_retention:
        # Checked before any table is touched, and not retried: a config error stays one.
        raise Failure(
            f"retention_hours={config.retention_hours} is below the {MIN_RETENTION_HOURS} h floor: vacuum could "
            "delete files a running batch has written but not committed yet. Set allow_short_retention: true "
            "in the maintain_tables op config only when no run writes the tables.",
            allow_retries=False,
        )
    results, duplicated = [], {}
    for name in SCHEMAS:
        result = tables.maintain(name, config.retention_hours, config.allow_short_retention)
        if name in KEYS and "skipped" not in result:
            result["duplicate_keys"] = tables.duplicate_keys(name, KEYS[name])
            if result["duplicate_keys"]:
                duplicated[name] = result["duplicate_keys"]
        context.log.info(f"{name}: {result}")
        results.append(result)
    if duplicated:  # after every table was maintained; not retried: a rerun finds the same rows
        raise Failure(
            "keys held by more than one row: "
            + ", ".join(f"{name} ({n} keys, key {', '.join(KEYS[name])})" for name, n in duplicated.items()),
            metadata={"duplicate_keys": duplicated},
            allow_retries=False,
        )
    return results


@job(description="Delta maintenance for all tables; safe to run while batches run (delta-rs retries conflicts).")
def table_maintenance():
    maintain_tables()
