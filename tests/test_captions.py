"""captions for a batch: real local Ray, real MLflow SQLite store, real Delta tables, tiny real model."""

import os

import polars as pl
import pytest
from dagster import AssetKey, materialize

from resources.mlflow_registry import MlflowRegistry
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from tests.fixtures.batches import materialize_slice
from tests.fixtures.samples import copy_samples
from video_assets.defs.captioning.assets import captions
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches

GOOD = ["realshort.mp4", "asl_eat.mkv", "no_duration.webm", "fire2.mp4"]
RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 8, "min_frames": 4}}}}


@pytest.mark.slow
def test_captions_for_a_batch_with_a_corrupt_file(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    copy_samples(volume_dir, GOOD + ["chaplin.mp4"])
    (volume_dir / "corrupt.mp4").write_bytes(os.urandom(40_000))
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        # The engine is pinned: "auto" would pick vLLM on a machine with a GPU and vLLM.
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=12, batch_size=2),
        **session_ray,  # the session's Ray, joined (the embedded one: tests/test_network_exposure.py)
    }
    plan = register_new_files(res["volume"], res["tables"])
    [key] = plan.batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success
    # Probed fine, then damaged before captioning: the CPU stage must turn it into an error row.
    (volume_dir / "chaplin.mp4").write_bytes(b"\x00" * 1000)

    def caption():
        result = materialize_slice([captions], key, instance=instance, resources=res, run_config=RUN_CONFIG)
        assert result.success
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks == {
            "unique_key": True,
            "required_columns": True,
            "captions_ok_rows_have_prose": True,
            "captions_videos_complete": True,
            # The corrupt file's decode error is the input's, not the engine's: not counted against the batch.
            "captions_mostly_captioned": True,
        }
        return pl.read_delta(res["tables"].table_uri("captions"))

    rows = caption()
    names = rows["uri"].str.split("/").list.last()
    rows = rows.with_columns(name=names)
    ok = rows.filter(pl.col("status") == "ok")
    assert sorted(ok["name"].unique()) == sorted(GOOD)
    assert (ok["prose"].str.len_chars() > 0).all()
    assert (ok["output_tokens"] > 0).all() and (ok["input_tokens"] > 0).all()
    assert set(ok["model_version"]) == {"1"} and set(ok["prompt_version"]) == {1}
    assert set(ok["engine"]) == {"transformers"}
    for ts, start, end in ok.select("frame_timestamps", "segment_start_s", "segment_end_s").iter_rows():
        assert 4 <= len(ts) <= 8 and ts == sorted(ts) and start <= ts[0] and ts[-1] <= end + 0.5
    errors = rows.filter(pl.col("status") == "error")
    assert sorted(errors["name"]) == ["chaplin.mp4", "corrupt.mp4"]
    assert errors.filter(pl.col("name") == "corrupt.mp4")["error"][0].startswith("not captioned: probe failed")
    assert errors.filter(pl.col("name") == "chaplin.mp4")["error"][0]

    mat = instance.get_latest_materialization_event(AssetKey("captions")).asset_materialization
    assert mat.metadata["engine_busy_s"].value > 0
    assert mat.metadata["cpu_stage_s"].value > 0
    assert mat.metadata["model_uri"].value == "models:/video-captioner@production"
    # Where the time went: the parts add up to the step's wall time; joining Ray is in the set-up.
    cost = mat.metadata["cost_breakdown"].value
    parts = cost["wall_s"]
    assert {"setup", "resolve_model", "delta", "job_startup", "job_streaming", "other", "total"} <= set(parts)
    assert abs(sum(v for k, v in parts.items() if k != "total") - parts["total"]) < 0.01 * parts["total"] + 0.05
    assert parts["setup"] > 0 and parts["job_startup"] > 0 and parts["delta"] > 0
    assert cost["busy_s"]["generation"] > 0 and cost["busy_s"]["decode_cpu"] > 0
    # ... and the throughput model calibrates on it (`video-assets predict`).
    from video_assets.cli import calibration
    from video_assets.core.throughput import StageCosts, predict

    [(measured, video_s, requests)] = calibration(instance)  # one batch size so far
    # vLLM's decode width calibrates on vLLM batches only (another engine's ratio would mis-size it).
    from video_assets.defs.caption_job import calibration_runs

    assert calibration_runs(instance, "transformers") == calibration(instance)
    assert calibration_runs(instance, "vllm") == []
    assert measured == cost and video_s > 0 and requests == len(GOOD) + 1  # + the damaged one
    costs = StageCosts.from_run(measured, video_s, requests, cpu_workers=1)
    assert predict(costs, video_s, 1).wall_s == pytest.approx(parts["total"], rel=0.01)

    # Rerun: cached videos are skipped, the failed one retried, and the row count stays the same.
    again = caption()
    assert again.height == rows.height
    mat = instance.get_latest_materialization_event(AssetKey("captions")).asset_materialization
    assert mat.metadata["videos_cached"].value == len(GOOD)


@pytest.mark.slow
def test_a_backfill_of_several_batches_is_captioned_in_one_run(
    instance, volume_dir, dagster_home, tiny_model_cache, session_ray
):
    """BackfillPolicy.single_run: a range of batches is one step and one Ray job (Ray and the model start
    once); every video lands in its own batch's rows, and a batch without video_metadata is named."""
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from resources.delta import DeltaTables
    from resources.volume import VideoVolume

    copy_samples(volume_dir, GOOD)
    res = {
        "volume": VideoVolume(uri=str(volume_dir), batch_size=2),
        "tables": DeltaTables(root_uri=str(dagster_home / "tables")),
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{dagster_home}/mlflow.db", artifact_root=str(dagster_home / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=8),
        "structurer": StructurerSettings(),
        **session_ray,
    }
    keys = list(register_new_files(res["volume"], res["tables"]).batches)
    assert len(keys) == 2
    instance.add_dynamic_partitions(video_batches.name, keys)
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    for key in keys:
        assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success

    def caption_range(first, last):
        return materialize(
            [captions, vlm_model, caption_prompt, raw_videos, video_metadata],
            selection=[captions],
            instance=instance,
            resources=res,
            run_config=RUN_CONFIG,
            tags={ASSET_PARTITION_RANGE_START_TAG: first, ASSET_PARTITION_RANGE_END_TAG: last},
            raise_on_error=False,
        )

    result = caption_range(keys[0], keys[-1])
    assert result.success
    mats = result.asset_materializations_for_node("captions")  # both batches, by this one run
    assert sorted(m.partition for m in mats) == sorted(keys)
    assert mats[0].metadata["batches"].value == 2 and mats[0].metadata["videos_captioned"].value == len(GOOD)
    assert instance.get_materialized_partitions(AssetKey("captions")) == set(keys)
    rows = pl.read_delta(res["tables"].table_uri("captions"))
    videos = pl.read_delta(res["tables"].table_uri("video_metadata")).select("video_id", "batch_key")
    assert rows.filter(pl.col("status") == "ok").height == len(GOOD)
    joined = rows.join(videos, on="video_id", suffix="_probed")
    assert joined.height == len(GOOD) and (joined["batch_key"] == joined["batch_key_probed"]).all()
    assert set(rows["batch_key"]) == set(keys)

    # A third batch registered but never probed: the range names it and captions nothing.
    copy_samples(volume_dir, ["carphone_distorted.mp4"])  # bundled: a fresh clone has no corpus
    [late] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [late])
    failed = caption_range(keys[0], late)
    assert not failed.success
    [event] = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
    assert repr(late) in event.step_failure_data.error.message
    assert pl.read_delta(res["tables"].table_uri("captions")).height == rows.height
