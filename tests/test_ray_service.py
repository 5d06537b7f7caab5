"""The long-lived local Ray (`video-assets ray up`): steps join it instead of embedding a Ray each, the
caption model served by Ray Serve for one batch serves the next (and structuring), and `ray down` stops every process it started.
Real Ray processes on 127.0.0.1, the real captions asset, the tiny real model."""

import json
import os
import subprocess
import sys

import polars as pl
import pytest
import ray
from dagster import materialize
from dagster_ray.configs import Lifecycle

from resources import ray_service
from resources.curation import CurationStore
from resources.llm import LlmSettings
from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import EmbeddedRay
from resources.ray_service import local_ray_address, ray_init_options, ray_outlives_steps
from resources.settings import embedded_ray_auth
from resources.structurer import StructurerSettings
from resources.vlm import TINY_MODEL_SOURCE, VlmSettings
from tests.fixtures.batches import caption_new_batch, materialize_slice, structure_batch
from video_assets.cli import _caption_model_chat
from video_assets.core.qa.agent import PLAN_SCHEMA
from video_assets.core.serving import llm
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.engines import TransformersStructurer
from video_assets.defs.curation.assets import frames
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.structured import structure_rows
from video_assets.defs.summaries.assets import video_summaries

RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 3, "min_frames": 2}}}}


def _cli(*args, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "video_assets.cli", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
    )


def _replicas(address) -> list[dict]:
    """The caption applications Serve runs on the service, each one's replica stats (one replica each here)."""
    from ray import serve

    from video_assets.core.serving.captioner import APP_PREFIX, stats

    with embedded_ray_auth():
        ray.init(address=address)
        try:
            return [{"app": n, **stats(n)} for n in serve.status().applications if n.startswith(APP_PREFIX)]
        finally:
            ray.shutdown()


@pytest.mark.slow
def test_steps_join_the_service_and_reuse_its_warm_engine(
    instance, resources, volume_dir, tiny_model_cache, tmp_path, monkeypatch
):
    assert ray_service.service_address() is None and not ray_outlives_steps()
    up = _cli("ray", "up", "--num-cpus", "2")
    assert up.returncode == 0, up.stderr
    try:
        address = ray_service.service_address()
        assert address and address.startswith("127.0.0.1:") and ray_outlives_steps()
        assert ray_init_options() == {} and local_ray_address() == address
        cmdlines = [" ".join(p.cmdline()) for p in ray_service.processes()]
        assert any("gcs_server" in c for c in cmdlines), cmdlines
        assert not [c for c in cmdlines if "ray.util.client.server" in c]  # no unauthenticated Ray Client port
        res = {
            **resources,
            "mlflow_registry": MlflowRegistry(
                tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
            ),
            # The settings `video-assets ray serve-config` reads from the environment below.
            "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers"),
            "ray_cluster": EmbeddedRay(ray_init_options=ray_init_options(), address=local_ray_address()),
        }
        assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
        pids = []
        for clips in (["realshort.mp4"], ["asl_eat.mkv", "fire2.mp4"]):
            key, result = caption_new_batch(instance, res, volume_dir, clips, RUN_CONFIG)
            assert result.success
            assert ray_service.service_address() == address  # the service outlived the step
            service = result.asset_materializations_for_node("captions")[0].metadata["engine_service"].value
            assert service["mode"] == "served" and service["replicas"] == 1
            pids.append(_replicas(address))
        # One application, one replica, the model loaded once, served both batches.
        assert len(pids[0]) == 1 and [(r["app"], r["pid"]) for r in pids[0]] == [(r["app"], r["pid"]) for r in pids[1]]
        assert pids[1][0]["loads"] == 1 and pids[1][0]["captioned"] == 3
        caps = pl.read_delta(res["tables"].table_uri("captions"))
        assert caps.height == 3 and (caps["status"] == "ok").all()

        # The Serve config the CLI writes for this instance's settings names the application the steps
        # deployed (what a cluster deploys with `serve deploy` is what the steps look for), with the
        # registered model's artifact for replicas on other nodes.
        env = {
            "MLFLOW_TRACKING_URI": res["mlflow_registry"].tracking_uri,
            "MLFLOW_ARTIFACT_ROOT": res["mlflow_registry"].artifact_root,
            "VLM_CACHE_DIR": str(tiny_model_cache),
            "VLM_ENGINE": "transformers",
        }
        written = _cli("ray", "serve-config", "--output", str(tmp_path / "captioner.yaml"), env=env)
        assert written.returncode == 0, written.stderr
        [app] = json.loads(
            "".join(ln for ln in (tmp_path / "captioner.yaml").read_text().splitlines() if not ln.startswith("#"))
        )["applications"]
        assert app["name"] == pids[1][0]["app"] and app["import_path"].endswith("captioner:build")
        assert str(tmp_path / "art") in app["args"]["engine"]["model"]["artifact_uri"]
        # With vLLM it is Ray Serve LLM's OpenAI application the steps deploy: named by its own args (what the
        # builder checks), at its route, with the registered model's artifact each replica fetches on its node.
        written = _cli("ray", "serve-config", env={**env, "VLM_ENGINE": "vllm"})
        assert written.returncode == 0, written.stderr
        [app] = json.loads("".join(ln for ln in written.stdout.splitlines() if not ln.startswith("#")))["applications"]
        assert app["import_path"] == llm.BUILDER and app["name"] == llm.app_name(llm.spec_from_args(app["args"]))
        assert app["route_prefix"] == f"/{app['name']}"
        assert str(tmp_path / "art") in app["args"]["model"]["artifact_uri"]

        # Structuring with the captioning model runs on the same warm engine (no second copy of the
        # model in the step) and decodes exactly what a structurer loaded in the step would.
        res["structurer"] = StructurerSettings(engine="transformers", device="cpu", max_new_tokens=64)
        res["ray_on_demand"] = EmbeddedRay(
            ray_init_options=ray_init_options(), address=local_ray_address(), lifecycle=Lifecycle(connect=False)
        )
        result = structure_batch(instance, res, key)
        assert result.success
        meta = result.asset_materializations_for_node("structured_events")[0].metadata
        assert meta["structuring_engine"].value == "transformers (served caption model)"
        [engine] = _replicas(address)
        assert (engine["app"], engine["pid"], engine["loads"]) == (pids[0][0]["app"], pids[0][0]["pid"], 1)
        events = pl.read_delta(res["tables"].table_uri("structured_events")).filter(pl.col("batch_key") == key)
        # The first pass for each caption, and a retry only for those whose first pass failed.
        retried = events.filter(pl.col("status").is_in(["retried", "unparsed"])).height
        assert events.height == 2 and engine["structured"] == 2 + retried
        uc = uc_mod.load("object_handling")
        batch_caps = caps.filter(pl.col("batch_key") == key).sort("video_id").to_dicts()
        local = structure_rows(
            TransformersStructurer(str(tiny_model_cache / TINY_MODEL_SOURCE), "cpu"),
            res["structurer"],
            uc,
            batch_caps,
            "local",
        )
        got = events.sort("video_id").select("status", "verdict", "raw_output").to_dicts()
        assert got == [{k: r[k] for k in ("status", "verdict", "raw_output")} for r in local]

        # Summaries with the caption model as their LLM (LLM_BASE_URL=captioner): the same replica answers
        # the chat turns, no other load; a summary per video, named after the application.
        res["llm"] = LlmSettings(base_url="captioner")
        result = materialize_slice([video_summaries], key, instance=instance, resources=res, raise_on_error=True)
        meta = result.asset_materializations_for_node("video_summaries")[0].metadata
        assert meta["summarizer"].value == f"llm:{engine['app']}" and meta["videos_summarized"].value == 2
        [after] = _replicas(address)
        assert (after["pid"], after["loads"]) == (engine["pid"], 1) and after["chat_calls"] >= 2
        summaries = pl.read_delta(res["tables"].table_uri("video_summaries")).filter(pl.col("batch_key") == key)
        assert summaries.height == 2 and (summaries["summarizer"] == f"llm:{engine['app']}").all()

        # Curation's frame descriptions on the same replica: every kept frame described there, no other load.
        res["curation"] = CurationStore(frames_dir=str(tmp_path / "frames"), exports_dir=str(tmp_path / "exports"))
        describe = {"ops": {"frames": {"config": {"describe": True}}}}
        result = materialize_slice([frames], key, instance=instance, resources=res, run_config=describe)
        assert result.success
        meta = result.asset_materializations_for_node("frames")[0].metadata
        assert meta["describe_engine"].value == f"served application {engine['app']}"
        kept = pl.read_delta(res["tables"].table_uri("frames")).filter(pl.col("kept"))
        assert kept.height > 0 and kept["description"].is_not_null().all()
        [described] = _replicas(address)
        # A description is a caption request on the same route (one frame each).
        assert (described["pid"], described["loads"]) == (engine["pid"], 1)
        assert described["captioned"] - after["captioned"] == kept.height

        # The ask box's LLM (`video-assets serve` with LLM_BASE_URL=captioner): the production version on the
        # same replica, joined from outside a step; a plan constrained to its JSON schema, then prose.
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        ray.shutdown()  # this process joins as the service process would
        with embedded_ray_auth():  # restores this process's Ray settings, which the service keeps for its life
            chat = _caption_model_chat(res["mlflow_registry"], 30.0)
            asked = chat.chat([{"role": "user", "content": "Who took a phone?"}], json_schema=PLAN_SCHEMA)
            answer = chat.chat([{"role": "user", "content": "Hi"}])
            ray.shutdown()
        assert set(json.loads(asked)) <= set(PLAN_SCHEMA["properties"]) and isinstance(answer, str)
        [after] = _replicas(address)
        assert (after["pid"], after["loads"]) == (engine["pid"], 1)
        # The plan constrained to its schema (a structuring request on the route), then a text turn.
        assert after["structured"] == described["structured"] + 1 and after["chat_calls"] == described["chat_calls"] + 1
    finally:
        # The in-process steps left this process a driver of the service's Ray (a run's own process exits
        # instead): disconnect first, or Ray ends this process once the service's GCS is gone.
        ray.shutdown()
        session = json.loads(ray_service.service_file().read_text())["pid"]
        down = _cli("ray", "down")
    assert down.returncode == 0, down.stderr
    # Every process of the service is gone: Ray's agents and workers too, whose command lines do not
    # name the session folder (they are found by the service's session). No Ray Client server ran.
    assert ray_service.service_address() is None and not ray_service.processes(session=session)
