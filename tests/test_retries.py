"""Explicit retry settings: the steps whose writes are idempotent retry transient errors; the steps
that record something new per attempt (an MLflow run, a decision) and captions (Ray's retries) do not."""

from dagster import AssetKey

from video_assets.definitions import defs
from video_assets.defs.common import TRANSIENT_RETRY
from video_assets.defs.maintenance.jobs import maintain_tables

RETRIED = ["vlm_model", "caption_prompt", "golden_set", "alerts", "review_queue"]
NOT_RETRIED = ["captions", "eval_scores", "promotion_decisions"]


def _policy(asset: str):
    return defs.resolve_assets_def(AssetKey(asset)).node_def.retry_policy


def test_idempotent_steps_retry_and_the_others_do_not():
    assert TRANSIENT_RETRY.max_retries >= 1 and TRANSIENT_RETRY.delay
    for asset in RETRIED:
        assert _policy(asset) == TRANSIENT_RETRY, asset
    assert maintain_tables.retry_policy == TRANSIENT_RETRY
    for asset in NOT_RETRIED:
        assert _policy(asset) is None, asset
