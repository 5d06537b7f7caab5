"""VLM_ENGINE=endpoint: captions and structuring through an OpenAI-compatible server, via Ray Data LLM's
HTTP stage, through the real assets (real Dagster, Ray, MLflow, Delta, bundled clips). The server is the
project's OpenAI-compatible test server (``tests/fixtures/openai_stub.py``: a hosted VLM cannot run here);
`make test-vllm-cpu` runs the same path against `vllm serve` on the tiny model."""

import json
import time

import numpy as np
import polars as pl
import pytest
from dagster import materialize

from tests.fixtures.batches import caption_new_batch, endpoint_resources, structure_batch
from tests.fixtures.openai_stub import stub_server
from video_assets.core.captioning.endpoint_engine import caption_payload
from video_assets.core.inference.endpoint import Endpoint, check_url
from video_assets.core.inference.retries import VLM_BATCH_RETRIES
from video_assets.core.media.frames import encode
from video_assets.defs.models.assets import caption_prompt, vlm_model

CLIPS = ["realshort.mp4", "asl_eat.mkv"]
RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 3, "min_frames": 2}}}}
CAPTION = "A person picks up a red cup and puts it down."
EVENT = {"start_s": 0.0, "end_s": 0.5, "actor": "person", "action": "picks up", "object": "cup"}
GOOD = {"verdict": "confirmed", "confidence": 0.9, "events": [EVENT], "rationale": "a cup is picked up"}
JSON_TURN = "one JSON object"  # the structuring request's system turn
WORD_TURN = "one word in double quotes"  # the verdict-only retry's system turn


def test_a_segment_is_one_chat_request_with_each_frame_after_its_time():
    frames = np.random.default_rng(0).integers(0, 255, (3, 32, 48, 3), dtype=np.uint8)
    body = caption_payload("m", frames, [0.0, 1.5, 3.0], "Describe.", 16)
    assert body["model"] == "m" and body["max_tokens"] == 16 and body["temperature"] == 0.0
    [message] = body["messages"]
    kinds = [p["type"] for p in message["content"]]
    assert kinds == ["text", "image_url"] * 3 + ["text"]
    assert [p["text"] for p in message["content"][:-1:2]] == ["Frame at 0.0s:", "Frame at 1.5s:", "Frame at 3.0s:"]
    assert message["content"][-1]["text"].endswith("Describe.") and "1.5s" in message["content"][-1]["text"]
    import base64
    import io

    from PIL import Image

    url = message["content"][1]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size == (48, 32)
    with pytest.raises(ValueError, match="one timestamp per frame"):
        caption_payload("m", frames, [0.0, 1.0], "Describe.", 16)
    # The CPU stage's JPEGs go into the request as they are: not decoded and encoded again.
    jpegs = encode(frames)
    sent = caption_payload("m", jpegs, [0.0, 1.5, 3.0], "Describe.", 16)["messages"][0]["content"][1::2][:3]
    assert [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in sent] == jpegs


def test_endpoint_settings_are_checked_and_the_key_is_never_shown():
    assert check_url(" http://127.0.0.1:8000/v1/ ") == "http://127.0.0.1:8000/v1"
    for bad, why in [
        ("ftp://host/v1", "not an http"),
        ("http://user:pw@host/v1", "must not carry credentials"),
        ("http://host/v1?key=1", "no query"),
        ("", "not an http"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_url(bad)
    endpoint = Endpoint("http://127.0.0.1:9/v1", "m", api_key="sk-secret")
    assert "sk-secret" not in repr(endpoint) and "sk-secret" not in json.dumps(endpoint.public())
    from video_assets.core.inference.endpoint import EndpointUnavailable

    with pytest.raises(EndpointUnavailable, match="VLM_ENDPOINT_URL"):
        Endpoint("http://127.0.0.1:9/v1", "m", timeout_s=2).check()  # nothing listens on port 9


def _resources(resources, session_ray, tmp_path, stub, secret: str, **vlm) -> dict:
    return endpoint_resources({**resources, **session_ray}, tmp_path, stub, secret, **vlm)


def _caption_batch(instance, res, volume_dir):
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    return caption_new_batch(instance, res, volume_dir, CLIPS, RUN_CONFIG)


def _logs(instance, run_id: str) -> str:
    return "\n".join(str(e.message) + repr(e.dagster_event) for e in instance.all_logs(run_id))


@pytest.mark.slow
def test_captions_and_structuring_through_an_openai_compatible_endpoint(
    instance, resources, session_ray, volume_dir, tmp_path
):
    secret = f"sk-{time.monotonic_ns()}"
    replies = {
        "model": "stub-vlm",
        "user_routes": {"Frames sampled at": CAPTION},
        # The first structuring answer is not JSON: only that caption gets the verdict-only retry.
        "routes": {JSON_TURN: ["not json", json.dumps(GOOD)], WORD_TURN: '"suspected"'},
    }
    with stub_server(replies, tmp_path) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, secret)
        key, result = _caption_batch(instance, res, volume_dir)
        assert result.success
        meta = result.asset_materializations_for_node("captions")[0].metadata
        assert meta["engine"].value == "endpoint" and meta["error_rows"].value == 0
        assert meta["engine_service"].value == {"mode": "endpoint", "url": stub.base_url, "model": "stub-vlm"}
        caps = pl.read_delta(res["tables"].table_uri("captions")).sort("uri")
        assert caps.height == len(CLIPS) and (caps["status"] == "ok").all() and (caps["prose"] == CAPTION).all()
        assert (caps["output_tokens"] == 1).all()  # the server's own usage count

        # The registry's version names the endpoint and its model (lineage), never the key.
        version = res["mlflow_registry"].client().get_model_version_by_alias("video-captioner", "production")
        assert version.tags["source_fingerprint"] == f"endpoint:{stub.base_url}#stub-vlm"

        sent = stub.requests()
        assert len(sent) == len(CLIPS)
        assert {r["model"] for r in sent} == {"stub-vlm"} and {r["_authorization"] for r in sent} == {
            f"Bearer {secret}"
        }
        images = sorted(sum(p["type"] == "image_url" for p in r["messages"][0]["content"]) for r in sent)
        assert images == sorted(len(t) for t in caps["frame_timestamps"])  # every sampled frame, as an image

        result = structure_batch(instance, res, key)
        assert result.success
        meta = result.asset_materializations_for_node("structured_events")[0].metadata
        assert meta["structuring_engine"].value == f"endpoint {stub.base_url} (stub-vlm)"
        events = pl.read_delta(res["tables"].table_uri("structured_events"))
        assert sorted(events["status"]) == ["parsed", "retried"]
        assert sorted(events["verdict"]) == ["confirmed", "suspected"]
        later = stub.requests()[len(sent) :]
        schema_requests = [r for r in later if r.get("response_format", {}).get("type") == "json_schema"]
        # A first pass per caption, and one retry: only for the caption whose first answer failed.
        assert len(later) == len(CLIPS) + 1 and len(schema_requests) == len(later)
        assert sum(WORD_TURN in r["messages"][0]["content"] for r in later) == 1
        assert "verdict" in schema_requests[0]["response_format"]["json_schema"]["schema"]["properties"]
    for run in instance.get_runs():  # the key reached the server, and nothing else
        assert secret not in _logs(instance, run.run_id) and secret not in repr(run.run_config)


@pytest.mark.slow
def test_an_endpoint_that_does_not_answer_fails_the_step_at_once_naming_the_setting(
    instance, resources, session_ray, volume_dir, tmp_path
):
    """The registered endpoint is down when a batch comes: the captions step fails before its Ray job,
    with a message naming VLM_ENDPOINT_URL, and writes nothing (the batch is captioned when it is back)."""
    with stub_server({"model": "stub-vlm"}, tmp_path) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x")
        assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    _, result = caption_new_batch(instance, res, volume_dir, CLIPS, RUN_CONFIG)  # the server is gone now
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = str(failure.event_specific_data.error)
    assert failure.step_key == "captions" and "VLM_ENDPOINT_URL" in error
    # At once, shown by the path taken: the check before the job (one GET /models, refused), not the job's
    # retried requests ("gave no answer after N tries") nor a timeout waited out.
    assert "did not answer" in error and "Connection refused" in error and "gave no answer" not in error, error
    assert not res["tables"].exists("captions")


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: a stalled server must not stall the run
@pytest.mark.parametrize("fault", [{"status": 503}, {"stall_s": 60}], ids=["errors", "stalls"])
def test_an_endpoint_that_errors_or_stalls_loses_no_video(
    instance, resources, session_ray, volume_dir, tmp_path, fault
):
    """Every request fails (HTTP 503, or no answer within the timeout): each is tried a bounded number of
    times with backoff, then its video is written as an error row with the reason; the run succeeds and
    nothing is missing, so the next run captions them again."""
    with stub_server({"model": "stub-vlm", "faults": {"Frames sampled at": fault}}, tmp_path) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x", endpoint_timeout_s=1.0)
        _, result = _caption_batch(instance, res, volume_dir)
        assert result.success, _logs(instance, result.run_id)[-3000:]
        caps = pl.read_delta(res["tables"].table_uri("captions"))
        assert sorted(caps["uri"].str.split("/").list.last()) == sorted(CLIPS)  # nothing lost
        assert (caps["status"] == "error").all() and caps["error"].str.contains("no result").all()
        sent = stub.requests()
        # One batch (both clips): its first request tried 1 + retries times by the HTTP stage, then the batch
        # is dropped: bounded, not forever.
        assert 1 + VLM_BATCH_RETRIES <= len(sent) <= len(CLIPS) * (1 + VLM_BATCH_RETRIES), len(sent)
        logs = _logs(instance, result.run_id)
        assert "gave no answer after" in logs or "no result" in logs
        assert "base64" not in logs  # the frames are not quoted in the logs
