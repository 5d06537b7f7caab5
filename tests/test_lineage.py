"""Versions carried by lineage: the production alias is resolved once, where captions are made, and
every later step of the batch works on the captions that step wrote, even when `production` moves
between two steps of one run. Real Dagster instance, real Ray, real MLflow store, tiny real model."""

import polars as pl
import pytest
from dagster import Definitions, HookContext, define_asset_job, materialize, success_hook
from dagster_ray.configs import Lifecycle
from mlflow import MlflowClient

from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import EmbeddedRay
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from tests.fixtures.samples import copy_samples
from video_assets.defs.captioning.assets import captions
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches
from video_assets.defs.routing.assets import routed_events
from video_assets.defs.structuring.assets import structured_events

MODEL = "video-captioner"


def _resources(base, session_ray, tmp_path, cache):
    return {
        **base,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(cache), max_new_tokens=8, batch_size=2),
        "structurer": StructurerSettings(device="cpu"),
        **session_ray,  # the session's Ray, joined
    }


def _new_production_version(tracking_uri: str) -> str:
    """Register another version of the caption model (same files) and move `production` to it."""
    client = MlflowClient(tracking_uri)
    current = client.get_model_version_by_alias(MODEL, "production")
    new = client.create_model_version(MODEL, source=current.source, run_id=current.run_id)
    client.set_registered_model_alias(MODEL, "production", new.version)
    return str(new.version)


@pytest.mark.slow
def test_production_moving_mid_run_does_not_mix_models(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path
):
    copy_samples(volume_dir, ["bottle-detection.mp4", "asl_eat.mkv"])
    res = _resources(resources, session_ray, tmp_path, tiny_model_cache)
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success
    moved = []

    @success_hook
    def move_production_after_captions(context: HookContext):
        if context.op.name == "captions":
            moved.append(_new_production_version(res["mlflow_registry"].tracking_uri))

    job = define_asset_job(
        "captions_then_events",
        selection=["captions", "structured_events", "alerts", "review_queue"],
        hooks={move_production_after_captions},
    )
    defs = Definitions(
        assets=[raw_videos, video_metadata, vlm_model, caption_prompt, captions, structured_events, routed_events],
        jobs=[job],
        resources=res,
    )
    result = defs.resolve_job_def("captions_then_events").execute_in_process(
        instance=instance,
        partition_key=key,
        run_config={"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}},
    )
    assert result.success
    assert moved == ["2"]  # production moved between the two steps
    client = MlflowClient(res["mlflow_registry"].tracking_uri)
    assert str(client.get_model_version_by_alias(MODEL, "production").version) == "2"

    def read(name):
        return pl.read_delta(res["tables"].table_uri(name))

    assert set(read("captions")["model_version"]) == {"1"}
    events = read("structured_events")
    assert events.height == read("captions").height and set(events["model_version"]) == {"1"}
    assert set(events["structurer"]) == {f"{MODEL}/v1"}  # the model that captioned, not the new alias
    routed = pl.concat([read("alerts").select("model_version"), read("review_queue").select("model_version")])
    assert set(routed["model_version"]) <= {"1"}  # (the tiny model often routes nothing)
    meta = {
        node: result.asset_materializations_for_node(node)[0].metadata
        for node in ("captions", "structured_events", "routed_events")
    }
    assert {node: m["model_version"].value for node, m in meta.items()} == dict.fromkeys(meta, "1")


def test_a_step_without_upstream_captions_fails_with_what_to_run(instance, resources, tmp_path):
    instance.add_dynamic_partitions(video_batches.name, ["nothing-yet"])
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"),
        "vlm": VlmSettings(cache_dir=str(tmp_path / "models")),
        "structurer": StructurerSettings(),
        "ray_on_demand": EmbeddedRay(lifecycle=Lifecycle(connect=False)),
    }
    result = materialize(
        [structured_events], partition_key="nothing-yet", instance=instance, resources=res, raise_on_error=False
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.event_specific_data.error.message
    assert "captions has not been materialised for batch 'nothing-yet'" in message
