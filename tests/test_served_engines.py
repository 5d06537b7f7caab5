"""Served engines: on a Ray cluster that outlives the job, the caption model is a Ray Serve application
that the next batch reuses (no second model load), that a new model or setting does not reuse, that
Serve brings back when a replica dies, and that scales to zero when idle. Real local Ray and Serve, the
tiny real model, bundled clips."""

import json
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from resources.settings import embedded_ray_auth, serve_http
from resources.vlm import VlmSettings
from video_assets.core.captioning.job import caption_rows
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.serving import engine_service
from video_assets.core.serving.captioner import (
    app_name,
    app_status,
    deploy,
    replicas,
    serve_config,
    served_endpoint,
    stats,
)
from video_assets.defs.engines import job_spec

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def _videos(names):
    return [
        {"video_id": n, "batch_key": "b", "uri": str(SAMPLES / n), "duration_s": None, "rotation": 0} for n in names
    ]


@pytest.fixture(scope="module")
def _module_ray(tmp_path_factory):
    """One embedded Ray and Serve for this module's tests (its start-up paid once): the product's embedded
    Ray, token authentication on, under an instance home of the module's own."""
    from ray import serve

    home = tmp_path_factory.mktemp("served") / "dagster_home"
    home.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DAGSTER_HOME", str(home))
        ray.shutdown()  # an earlier in-process step may have left this process connected to its Ray
        with embedded_ray_auth():
            ray.init(num_cpus=2, include_dashboard=False)
            try:
                yield home
            finally:
                serve.shutdown()
                ray.shutdown()


@pytest.fixture
def local_ray(_module_ray):
    """The module's Ray and Serve, with no application left by an earlier test (each test counts its own
    replicas and model loads)."""
    from ray import serve

    if not ray.is_initialized():
        pytest.fail("this module's Ray was shut down by an earlier test")
    yield
    for name in list(serve.status().applications):
        serve.delete(name)


def _spec(tiny_model, idle_s: float, **vlm):
    settings = VlmSettings(cache_dir="/tmp", engine="transformers", **{"max_new_tokens": 4, "batch_size": 4, **vlm})
    spec = job_spec(
        SamplingConfig(min_frames=2, max_frames=3), settings, "transformers", ModelFiles(str(tiny_model)), "Describe."
    )
    return replace(spec, warm_idle_s=idle_s, serve=serve_http())  # as job_spec sets them under `ray up`


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    pytest.fail(what)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_next_batch_reuses_the_loaded_replica_which_scales_to_zero_when_idle(local_ray, tiny_model):
    # Idle 15 s: well above the gap between two jobs on a loaded machine, so the second finds the replica.
    spec = _spec(tiny_model, idle_s=15.0)
    name = app_name(spec)

    first = list(caption_rows(_videos(["realshort.mp4", "asl_eat.mkv"]), spec))
    assert [r["status"] for r in first] == ["ok", "ok"] and all(r["prose"] for r in first), [r["error"] for r in first]
    replica = stats(name)
    assert {r["engine_node"] for r in first} == {replica["node"]}
    # The route answers the instance's key only (the proxy is on loopback; other local users have no key).
    route = served_endpoint(spec)
    for key in ("", "not-the-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{route['url']}/models", headers=headers), timeout=30)
        assert refused.value.code == 401
    assert route["url"].startswith(f"http://127.0.0.1:{serve_http()['port']}/")
    second = list(caption_rows(_videos(["fire2.mp4"]), spec))
    assert [r["status"] for r in second] == ["ok"]
    again = stats(name)
    # The same process, the model loaded once, both jobs' segments captioned by it.
    assert again["replica"] == replica["replica"] and again["loads"] == 1 and again["captioned"] == 3
    assert engine_service(spec) == {"mode": "served", "application": name, "deployment": "Captioner", "replicas": 1}

    # Another model (or any setting that changes what an engine computes) gets its own application.
    assert app_name(replace(spec, engine=replace(spec.engine, max_new_tokens=5))) != name

    # Idle: Serve stops the replica (its memory, and on a GPU its GPU, given back) ...
    _wait(lambda: replicas(name) == 0, 120, "the idle replica did not scale to zero")
    # ... and the next batch brings one back.
    third = list(caption_rows(_videos(["realshort.mp4"]), spec))
    assert [r["status"] for r in third] == ["ok"]
    assert replicas(name) == 1 and stats(name)["replica"] != replica["replica"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_model_retires_the_idle_application_of_the_old_one(local_ray, tiny_model):
    """An idle application of another model (or settings, or code) is deleted when a new one is deployed:
    its replica would otherwise hold its CPU, GPU or pinned resources until it scaled to zero."""
    old = _spec(tiny_model, idle_s=3600.0)
    new = replace(old, engine=replace(old.engine, max_new_tokens=5))
    deploy(old)
    assert app_status(app_name(old)) == "RUNNING" and replicas(app_name(old)) == 1
    assert [r["status"] for r in caption_rows(_videos(["realshort.mp4"]), new)] == ["ok"]
    assert app_status(app_name(old)) is None and replicas(app_name(new)) == 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_replica_that_dies_under_a_batch_is_replaced_and_nothing_is_lost(local_ray, tiny_model):
    """Killing the replica mid-job fails the batches it held; Serve starts another, the batches are sent
    again, and every segment comes back once, ok."""
    spec = _spec(tiny_model, idle_s=60.0, max_new_tokens=64, batch_size=1)  # long generations: batches queue
    names = ["realshort.mp4", "asl_eat.mkv", "fire2.mp4", "tree.avi", "carphone_distorted.mp4"]
    deploy(spec)
    before = stats(app_name(spec))["pid"]  # asked now: later it would queue behind batches
    rows = caption_rows(_videos(names), spec)
    first = next(rows)
    import psutil

    psutil.Process(before).kill()  # the replica's process, under the next batch
    got = [first, *rows]
    assert sorted(r["video_id"] for r in got) == sorted(names)  # each once
    assert all(r["status"] == "ok" and r["prose"] for r in got), [
        (r["video_id"], r["status"], r["error"], r["prose"]) for r in got
    ]
    assert stats(app_name(spec))["pid"] != before  # served by a new replica


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: the point is that the job ends
def test_a_stalled_replica_gives_error_rows_naming_the_timeout_and_the_job_ends(local_ray, tiny_model):
    """A replica that is alive but answers nothing (its process stopped: an NCCL stall, a wedged engine;
    Serve's health check has not noticed yet): each batch waits the request timeout, then its segments are
    error rows naming it, and the job ends instead of waiting forever."""
    import psutil

    spec = replace(_spec(tiny_model, idle_s=60.0, batch_size=1), request_timeout_s=3.0)
    names = ["realshort.mp4", "asl_eat.mkv"]
    deploy(spec)
    replica = psutil.Process(stats(app_name(spec))["pid"])
    replica.suspend()
    try:
        got = list(caption_rows(_videos(names), spec))
    finally:
        replica.resume()
    assert sorted(r["video_id"] for r in got) == sorted(names)  # nothing lost
    for r in got:
        assert r["status"] == "error" and r["error"].startswith("timed out"), r["error"]
        assert "3 s (VLM_REQUEST_TIMEOUT_S)" in r["error"]


class _Encoder:
    """A model stage of an archive job: one actor, one CPU."""

    def __call__(self, batch):
        return {"n": [int(x) * 2 for x in batch["n"]]}


def _split(row):
    return [{"n": row["n"]}]


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: the stage must not wait for the replica's idle delay (an hour here)
def test_an_idle_caption_replica_does_not_make_the_next_stage_wait(local_ray, tiny_model):
    """An archive stage after captions on the long-lived Ray, on 2 CPUs: the stage needs an encoder actor
    and a decode task, and the idle caption replica (loaded, an hour from scaling to zero) reserves no CPU
    of them, so the stage runs now and the replica stays loaded for the next batch."""
    from video_assets.core.inference.stages import StageSpec, stream

    spec = _spec(tiny_model, idle_s=3600.0)
    deploy(spec)
    before = stats(app_name(spec))
    assert before["busy"] == 0  # up and idle

    rows = list(stream([{"n": i} for i in range(4)], _split, {}, _Encoder, {}, StageSpec(1, 1, 0.0, 2)))
    assert sorted(r["n"] for r in rows) == [0, 2, 4, 6]
    assert stats(app_name(spec))["pid"] == before["pid"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_serve_config_deploys_the_application_the_steps_use(local_ray, tiny_model, tmp_path):
    """The Serve config of a spec, deployed the way a cluster deploys configs (`serve run` of the file: Serve's
    controller builds the application from its import_path and args), is the application the steps look for:
    the next job uses its replica as it is (no second deploy, one model load). A config whose settings were
    edited under the same name is refused by its replica, so a step never takes it for another model."""
    from click.testing import CliRunner
    from ray import serve
    from ray.serve.scripts import cli

    spec = _spec(tiny_model, idle_s=600.0)
    name = app_name(spec)
    config = tmp_path / "captioner.yaml"
    config.write_text(json.dumps(serve_config(spec)))
    ran = CliRunner().invoke(cli, ["run", "--non-blocking", str(config)])
    assert ran.exit_code == 0, ran.output
    _wait(lambda: app_status(name) == "RUNNING", 180, f"the config's application did not start: {serve.status()}")
    replica = stats(name)

    rows = list(caption_rows(_videos(["realshort.mp4"]), spec))
    assert [r["status"] for r in rows] == ["ok"] and rows[0]["prose"]
    again = stats(name)
    assert (again["replica"], again["loads"], again["captioned"]) == (replica["replica"], 1, 1)

    edited = serve_config(spec)
    edited["applications"][0]["args"]["engine"]["max_new_tokens"] = 9  # another engine under the old name
    config.write_text(json.dumps(edited))
    ran = CliRunner().invoke(cli, ["run", "--non-blocking", str(config)])
    assert ran.exit_code == 0, ran.output
    _wait(lambda: app_status(name) == "DEPLOY_FAILED", 180, f"the edited config was not refused: {serve.status()}")
    refused = serve.status().applications[name].deployments["Captioner"].message
    assert "its settings make it" in refused and "video-assets ray serve-config" in refused


def test_a_step_uses_the_ray_its_process_already_joined(local_ray):
    """In a run whose steps share one process (`video-assets demo` under `ray up`: ``execute_in_process``)
    the run's ``ray_cluster`` resource joined Ray at the start; a step's on-demand Ray resource (structuring
    on the served caption model) uses that connection instead of a second ``ray.init`` (an error)."""
    from dagster_ray.configs import Lifecycle

    from resources.ray_cluster import EmbeddedRay
    from video_assets.defs.ray_session import connect_ray

    on_demand = EmbeddedRay(lifecycle=Lifecycle(connect=False))
    assert connect_ray(None, on_demand) == 0.0  # this Ray's GPUs: none
    assert ray.is_initialized() and not on_demand.connected
