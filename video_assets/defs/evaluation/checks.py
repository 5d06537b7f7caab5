"""Asset checks of the evaluation tables: generated key checks and the score floors."""

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, Config, asset_check
from pydantic import Field

from resources.delta import DeltaTables
from video_assets.core.tables import EVAL_SCORES, GOLDEN_SET, SCHEMAS
from video_assets.defs.common import table_checks
from video_assets.defs.evaluation.assets import eval_scores


class FloorsConfig(Config):
    min_flagged_f1: float = Field(default=0.0, ge=0, le=1)
    min_coverage: float = Field(default=0.9, ge=0, le=1)
    min_event_f1: float = Field(default=0.0, ge=0, le=1)


@asset_check(
    asset=eval_scores,
    description="The latest production scores of every use case stay at or above the floors (set in the launchpad).",
)
def eval_scores_above_floors(config: FloorsConfig, tables: DeltaTables) -> AssetCheckResult:
    floors = {"flagged_f1": config.min_flagged_f1, "coverage": config.min_coverage, "event_f1": config.min_event_f1}
    df = tables.read(EVAL_SCORES, SCHEMAS[EVAL_SCORES]).filter(pl.col("candidate") == "production")
    latest = df.sort("evaluated_at").group_by("use_case").last()
    below = {
        f"{r['use_case']}.{k}": round(r[k], 4) for r in latest.to_dicts() for k, floor in floors.items() if r[k] < floor
    }
    return AssetCheckResult(
        passed=not below and latest.height > 0,
        severity=AssetCheckSeverity.ERROR,
        metadata={"floors": floors, "below_floor": below, "use_cases": latest.height},
    )


evaluation_checks = [table_checks(GOLDEN_SET), table_checks(EVAL_SCORES), eval_scores_above_floors]
