"""Rows downstream of captions follow them: a batch captioned under three splits in turn (whole videos,
3 s clips, 5 s clips: segments appear, move and vanish) is structured and routed after each, and every
structured and routed row then describes a current caption, with the counts of the captions. Real local
Ray, MLflow SQLite store, Delta tables and the tiny real Qwen2.5-VL."""

import polars as pl
import pytest
from dagster import materialize

from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from tests.fixtures.samples import copy_samples
from video_assets.core.structuring.versions import rows_without_caption
from video_assets.defs.captioning.assets import captions
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches
from video_assets.defs.routing.assets import routed_events
from video_assets.defs.routing.checks import routing_checks
from video_assets.defs.structuring.assets import structured_events
from video_assets.defs.structuring.checks import structuring_checks

SPLITS = [None, 3.0, 5.0]  # chaplin.mp4 (9.6 s): 1, then 3, then 2 segments; asl_eat.mkv (1.6 s): 1 each


@pytest.mark.slow
def test_three_splits_leave_no_row_describing_a_replaced_caption(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    copy_samples(volume_dir, ["chaplin.mp4", "asl_eat.mkv"])
    res = {
        **resources,
        **session_ray,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), max_new_tokens=8, batch_size=2),
        "structurer": StructurerSettings(device="cpu", use_cases="object_handling,loss_prevention"),
    }
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success

    def read(name):
        return pl.read_delta(res["tables"].table_uri(name))

    segments, previous = [], 0
    for segment_s in SPLITS:
        run = materialize(
            [captions, structured_events, routed_events, *structuring_checks, *routing_checks],
            partition_key=key,
            instance=instance,
            resources=res,
            run_config={"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2, "segment_s": segment_s}}}},
        )
        assert run.success
        checks = {e.check_name: e.passed for e in run.get_asset_check_evaluations()}
        assert checks["structured_events_follow_captions"] and checks["alerts_follow_captions"], checks
        assert checks["review_queue_follow_captions"], checks

        caps, events = read("captions"), read("structured_events")
        routed = pl.concat([read("alerts"), read("review_queue")], how="diagonal_relaxed")
        segments.append(caps.height)
        # Every structured and routed row describes a current caption: same segment, window and text.
        assert events.get_column("caption_digest").null_count() == 0
        assert rows_without_caption(events, caps).is_empty()
        assert rows_without_caption(routed, caps).is_empty()
        assert events.height == 2 * caps.height  # one row per caption and use case, none left over
        windows = caps.select("video_id", "segment", "segment_start_s", "segment_end_s")
        joined = routed.join(windows, on=["video_id", "segment"], how="left")  # the caption's own window
        assert (joined["start_s"] >= joined["segment_start_s"] - 1e-6).all()
        assert (joined["end_s"] <= joined["segment_end_s"] + 1e-6).all()
        meta = run.asset_materializations_for_node("structured_events")[0].metadata
        assert meta["stale_rows_removed"].value == (0 if segment_s is None else 2 * previous)
        assert meta["events_outside_clip"].value == events.get_column("events_outside").sum()
        previous = caps.height
    assert segments == [2, 4, 3]  # the splits really changed the segments
