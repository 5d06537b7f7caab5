"""The command-line path CI uses: register the volume, then `dagster asset materialize` the model
assets and the whole per-batch graph for a range of partitions in one run, each in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tests.fixtures.samples import REPO, copy_samples

BIN = Path(sys.executable).parent

pytestmark = pytest.mark.e2e


def sh(args, env, timeout=600):
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_register_then_dagster_asset_materialize(dagster_home, volume_dir):
    copy_samples(volume_dir, ["realshort.mp4", "asl_eat.mkv"])
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "VIDEO_VOLUME_URI": str(volume_dir)}
    out = sh([str(BIN / "video-assets"), "register", "--batch-size", "1"], env)
    keys = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("new batch")]
    assert len(keys) == 2
    materialize = [str(BIN / "dagster"), "asset", "materialize", "-m", "video_assets.definitions", "--select"]
    sh(materialize + ["vlm_model,caption_prompt"], env)
    per_batch = "raw_videos,video_metadata,captions,structured_events,alerts,review_queue"
    # Both batches in one run, as a backfill runs them (every per-batch asset is BackfillPolicy.single_run).
    out = sh(materialize + [per_batch, "--partition-range", f"{keys[0]}...{keys[1]}"], env)
    assert out.count("RUN_SUCCESS") == 1, out[-3000:]
    sh(materialize + ["golden_set,eval_scores"], env)
    meta = pl.read_delta(str(dagster_home / "tables" / "video_metadata"))
    assert sorted(meta["uri"].str.split("/").list.last()) == ["asl_eat.mkv", "realshort.mp4"]
    assert sorted(meta["batch_key"]) == sorted(keys)  # a video per batch, each in its own
    assert meta["ok"].all()
    caps = pl.read_delta(str(dagster_home / "tables" / "captions"))
    assert sorted(caps["uri"].str.split("/").list.last()) == ["asl_eat.mkv", "realshort.mp4"]
    assert (caps["status"] == "ok").all() and (caps["prose"].str.len_chars() > 0).all()
    events = pl.read_delta(str(dagster_home / "tables" / "structured_events"))
    assert events.height == caps.height and set(events["use_case"]) == {"object_handling"}
    for name in ("alerts", "review_queue"):
        assert (dagster_home / "tables" / name / "_delta_log").is_dir()
    scores = pl.read_delta(str(dagster_home / "tables" / "eval_scores"))
    assert scores["scored_videos"].to_list() == [2] and scores["candidate"].to_list() == ["production"]
