"""VLM_ENGINE=endpoint: captions and structuring through an OpenAI-compatible server, via the request
stage (``core.inference.endpoint``), through the real assets (real Dagster, Ray, MLflow, Delta, bundled clips). The server is the
project's OpenAI-compatible test server (``tests/fixtures/openai_stub.py``: a hosted VLM cannot run here);
`make test-vllm-cpu` runs the same path against `vllm serve` on the tiny model."""

import json
import time

import numpy as np
import polars as pl
import pytest
from dagster import materialize

from tests.fixtures.batches import caption_new_batch, endpoint_resources, materialize_slice, structure_batch
from tests.fixtures.openai_stub import stub_server
from video_assets.core.captioning.endpoint_engine import caption_payload
from video_assets.core.inference.endpoint import Endpoint, check_url
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
        images_sent = "image parts, times in the text (the endpoint takes no video: VLM_ENDPOINT_VIDEO off)"
        service = {"mode": "endpoint", "url": stub.base_url, "model": "stub-vlm", "request": images_sent}
        assert meta["engine_service"].value == service
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


def test_each_request_is_bounded_and_fails_alone(tmp_path):
    """One batch through the request stage (the class Ray Data runs as its actor, driven here directly): a
    request answered 429 every time, one answered with a body that is not JSON, one with a 50 MB body and one
    never answered are each an error row with its own reason; the healthy requests beside them are answered;
    only the rate-limited one is tried again, a bounded number of times."""
    import asyncio

    from video_assets.core.inference.endpoint import (
        ERROR_KEY,
        PAYLOAD,
        EndpointRequests,
        error_row,
        payload_row,
        read_answer,
    )

    faults = {
        "RATE": {"status": 429, "retry_after": 0},
        "NOTJSON": {"body": "{not json"},
        "HUGE": {"big_mb": 50},
        "STALL": {"stall_s": 60},
    }
    markers = ["OK-1", *faults, "OK-2"]

    def request(marker: str) -> dict:
        return {"model": "stub-vlm", "messages": [{"role": "user", "content": f"segment {marker}"}], "max_tokens": 4}

    rows = [payload_row(request(m)) for m in markers] + [error_row("decode failed: damaged")]
    batch = {PAYLOAD: [r[PAYLOAD] for r in rows], ERROR_KEY: [r[ERROR_KEY] for r in rows], "id": [*markers, "DAMAGED"]}
    with stub_server({"model": "stub-vlm", "default": "a caption", "faults": faults}, tmp_path) as stub:
        stage = EndpointRequests(Endpoint(stub.base_url, "stub-vlm", timeout_s=3.0, retries=2))
        out = asyncio.run(stage(batch))
        sent = [r["messages"][0]["content"].split()[-1] for r in stub.requests()]
    answers = dict(zip(out["id"], map(read_answer, [dict(zip(out, values)) for values in zip(*out.values())])))
    assert answers["OK-1"].text == answers["OK-2"].text == "a caption" and not answers["OK-1"].error
    assert answers["RATE"].error.startswith("rate limited: HTTP 429") and "after 3 tries" in answers["RATE"].error
    assert answers["NOTJSON"].error.startswith("unparsable answer"), answers["NOTJSON"].error
    assert answers["HUGE"].error.startswith("oversized answer"), answers["HUGE"].error
    assert answers["STALL"].error.startswith("timed out") and "VLM_REQUEST_TIMEOUT_S" in answers["STALL"].error
    assert answers["DAMAGED"].error == "decode failed: damaged"
    # Retried: only the 429 (1 + retries); a timed-out request is not sent again; the error row never is.
    assert sorted(sent) == sorted([*markers, "RATE", "RATE"]), sent


@pytest.mark.slow
@pytest.mark.timeout(300)  # a hang guard: a stalled server must not stall the run
def test_a_segment_the_endpoint_never_answers_is_an_error_row_and_the_others_are_captioned(
    instance, resources, session_ray, volume_dir, tmp_path
):
    """One clip's request is accepted and never answered, in the same batch as a healthy one: the step ends
    after the request timeout (not tried again), that clip is an error row naming the timeout, the other is
    captioned, and the next run captions only the missing one."""
    from video_assets.core.captioning.requests import timestamps_text
    from video_assets.defs.captioning.assets import captions

    replies = {"model": "stub-vlm", "user_routes": {"Frames sampled at": CAPTION}}
    with stub_server(replies, tmp_path / "a") as stub:  # first, every clip captioned: its frame times known
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x", endpoint_timeout_s=2.0)
        key, result = _caption_batch(instance, res, volume_dir)
        assert result.success
    first = pl.read_delta(res["tables"].table_uri("captions")).sort("uri")
    stalled, healthy = first["uri"][0], first["uri"][1]
    marker = timestamps_text(list(first["frame_timestamps"][0]))
    assert marker != timestamps_text(list(first["frame_timestamps"][1]))  # it picks out one clip
    again = {"ops": {"captions": {"config": {**RUN_CONFIG["ops"]["captions"]["config"], "recaption": True}}}}
    port = int(stub.base_url.rsplit(":", 1)[1].split("/")[0])  # the registered endpoint: the same URL
    with stub_server({**replies, "faults": {marker: {"stall_s": 120}}}, tmp_path / "b", port) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x", endpoint_timeout_s=2.0)
        result = materialize_slice([captions], key, instance=instance, resources=res, run_config=again)
        assert result.success, _logs(instance, result.run_id)[-3000:]
        sent = stub.requests()
    caps = pl.read_delta(res["tables"].table_uri("captions")).sort("uri")
    by_uri = {r["uri"]: r for r in caps.iter_rows(named=True)}
    assert by_uri[healthy]["status"] == "ok" and by_uri[healthy]["prose"] == CAPTION
    assert by_uri[stalled]["status"] == "error" and "timed out" in by_uri[stalled]["error"]
    assert "VLM_REQUEST_TIMEOUT_S" in by_uri[stalled]["error"]
    assert len(sent) == len(CLIPS)  # the stalled request was sent once
    messages = "\n".join(str(e.message) for e in instance.all_logs(result.run_id))
    assert "base64" not in messages  # the request (its frames) is not quoted in the log lines
    with stub_server(replies, tmp_path / "c", port) as stub:  # the server is well again: the rerun completes the batch
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x", endpoint_timeout_s=2.0)
        result = materialize_slice([captions], key, instance=instance, resources=res, run_config=RUN_CONFIG)
        assert result.success
        assert len(stub.requests()) == 1  # only the missing segment
    caps = pl.read_delta(res["tables"].table_uri("captions"))
    assert (caps["status"] == "ok").all() and caps.height == len(CLIPS)


def test_error_share_counts_only_segments_the_engine_was_sent():
    from datetime import datetime, timedelta

    from video_assets.core.captioning.versions import error_share

    t = datetime(2026, 1, 1)

    def row(seg, status, error=None, times=(0.0, 1.0), version="2", at=t):
        return {
            "segment": seg,
            "status": status,
            "error": error,
            "frame_timestamps": list(times),
            "model_version": version,
            "prompt_version": 1,
            "captioned_at": at,
        }

    df = pl.DataFrame(
        [
            row(0, "ok"),
            row(1, "error", "timed out"),
            row(2, "error", "timed out"),
            row(3, "error", "SamplingError: damaged", times=()),  # never decoded: not the engine's
            row(0, "error", "old", version="1", at=t - timedelta(days=1)),  # an earlier model's rows
        ]
    )
    share = error_share(df)
    assert (share["segments"], share["errors"], share["reasons"]) == (3, 2, ["timed out"])
    assert share["error_share"] == pytest.approx(2 / 3)
    assert error_share(df.head(0))["error_share"] == 0.0


@pytest.mark.slow
def test_a_batch_the_endpoint_failed_is_blocked_and_the_demo_says_why(
    instance, resources, session_ray, volume_dir, tmp_path
):
    """Every request refused (HTTP 400): each clip is an error row (nothing lost), the blocking captions check
    fails, so structuring does not run on a batch with nothing captioned and the run fails saying why."""
    from video_assets.cli import failed_checks
    from video_assets.defs.structuring.assets import structured_events

    with stub_server({"model": "stub-vlm", "faults": {"Frames sampled at": {"status": 400}}}, tmp_path) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x")
        assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
        from tests.fixtures.samples import copy_samples
        from video_assets.defs.captioning.assets import captions
        from video_assets.defs.ingest.assets import raw_videos, video_metadata
        from video_assets.defs.ingest.registration import register_new_files
        from video_assets.defs.partitions import video_batches

        copy_samples(volume_dir, CLIPS)
        [key] = register_new_files(res["volume"], res["tables"]).batches
        instance.add_dynamic_partitions(video_batches.name, [key])
        result = materialize_slice(
            [raw_videos, video_metadata, captions, structured_events],
            key,
            instance=instance,
            resources=res,
            run_config=RUN_CONFIG,
        )
    assert not result.success
    caps = pl.read_delta(res["tables"].table_uri("captions"))
    assert caps.height == len(CLIPS) and (caps["status"] == "error").all()  # nothing lost
    assert caps["error"].str.starts_with("endpoint error: HTTP 400").all()
    assert not res["tables"].exists("structured_events")  # blocked: nothing structured from it
    [line] = failed_checks(result)
    assert "captions_mostly_captioned" in line and "VLM_MAX_ERROR_SHARE" in line and "2 of 2" in line


@pytest.mark.slow
def test_frame_descriptions_go_to_the_endpoint_that_captioned(instance, resources, session_ray, volume_dir, tmp_path):
    """VLM_ENGINE=endpoint with frame descriptions on: curation describes each kept frame through the
    registered endpoint (one image per request, the captions' request), not an engine it cannot load."""
    from resources.curation import CurationStore
    from video_assets.defs.curation.assets import frames

    replies = {"model": "stub-vlm", "user_routes": {"Frames sampled at": CAPTION}}
    with stub_server(replies, tmp_path) as stub:
        res = _resources(resources, session_ray, tmp_path, stub, "sk-x")
        res["curation"] = CurationStore(frames_dir=str(tmp_path / "frames"), exports_dir=str(tmp_path / "exports"))
        key, result = _caption_batch(instance, res, volume_dir)
        assert result.success
        captioned = len(stub.requests())
        describe = {"ops": {"frames": {"config": {"describe": True}}}}
        result = materialize_slice([frames], key, instance=instance, resources=res, run_config=describe)
        assert result.success, _logs(instance, result.run_id)[-3000:]
        described = stub.requests()[captioned:]
    meta = result.asset_materializations_for_node("frames")[0].metadata
    assert meta["describe_engine"].value == f"endpoint {stub.base_url} (stub-vlm)"
    kept = pl.read_delta(res["tables"].table_uri("frames")).filter(pl.col("kept"))
    assert kept.height >= 1 and (kept["description"] == CAPTION).all()  # the endpoint's answer, stored
    assert len(described) == kept.height
    for r in described:
        assert sum(p["type"] == "image_url" for p in r["messages"][0]["content"]) == 1


def _clip_frames(n: int = 4) -> tuple[list[bytes], list[float]]:
    """A real clip's first frames as the decode stage hands them on (JPEG, small), with their times."""
    import av

    from tests.fixtures.samples import BUNDLED
    from video_assets.core.media.frames import encode_one

    jpegs, times = [], []
    with av.open(str(BUNDLED / "realshort.mp4")) as container:
        for frame in container.decode(video=0):
            jpegs.append(encode_one(np.asarray(frame.to_image().resize((64, 48)))))
            times.append(float(frame.time))
            if len(jpegs) == n:
                break
    return jpegs, times


def test_every_transport_sends_one_request_and_the_model_sees_the_same_video(tmp_path, tiny_model):
    """One segment through the in-job transformers engine, an endpoint that takes video (the stub here; the
    served caption application is one, and `vllm serve`) and the in-job vLLM engine: the same frames, text and
    timing. The request the server receives, read back as the served application reads it, is the in-job
    engine's own; for the tiny model both give the processor the same pixels and second_per_grid_ts."""
    from video_assets.core.captioning.endpoint_engine import EndpointEngine
    from video_assets.core.captioning.requests import CaptionRequest, VideoChat
    from video_assets.core.captioning.transformers_engine import TransformersEngine
    from video_assets.core.captioning.vllm_engine import to_vllm_row
    from video_assets.core.media.frames import decode

    jpegs, times = _clip_frames()
    prompt = "Describe what the hands do."
    with stub_server({"model": "stub-vlm", "default": CAPTION}, tmp_path) as stub:
        fields = {"url": stub.base_url, "model": "stub-vlm", "video": True, "retries": 0}
        [answer] = EndpointEngine(fields).generate([CaptionRequest("s", jpegs, times, prompt, max_new_tokens=8)])
        [received] = stub.requests()
    assert answer.error is None and answer.text == CAPTION
    [part] = [p for p in received["messages"][0]["content"] if p["type"] == "video_url"]  # one video, no images
    assert received["mm_processor_kwargs"]["do_sample_frames"] is False

    # In the job, the engine decodes the decode stage's JPEGs (batch.caption_batch) and builds its request.
    in_job = VideoChat.of(CaptionRequest("s", decode(jpegs), times, prompt, max_new_tokens=8))
    served = VideoChat.from_openai("s", received, 8)  # what the served application's route builds
    assert np.array_equal(served.frames, in_job.frames)
    assert served.metadata == in_job.metadata and in_job.metadata["fps"] != 24  # the frames' real rate
    assert served.messages[-1]["content"][-1] == in_job.messages[-1]["content"][-1]  # the times and instruction
    # The in-job vLLM engine is sent the very same messages and timing.
    row = to_vllm_row(CaptionRequest("s", jpegs, times, prompt, max_new_tokens=8))
    assert row["messages"] == [{k: m[k] for k in ("role", "content")} for m in received["messages"]]
    assert row["mm_processor_kwargs"] == received["mm_processor_kwargs"]

    engine = TransformersEngine(str(tiny_model), device="cpu", max_new_tokens=8)
    a, b = engine.prepare([in_job]), engine.prepare([served])
    assert float(a["second_per_grid_ts"][0]) == float(b["second_per_grid_ts"][0])
    assert np.array_equal(a["pixel_values_videos"].numpy(), b["pixel_values_videos"].numpy())
    assert a["input_ids"].tolist() == b["input_ids"].tolist()


def test_a_structuring_request_reaches_the_served_model_as_the_in_job_structurer_gets_it():
    from video_assets.core.serving.captioner import structure_request
    from video_assets.core.structuring.engines import structure_payload
    from video_assets.core.structuring.policy import StructureRequest

    schema = {"type": "object", "properties": {"verdict": {"enum": ["confirmed", "none"]}}, "required": ["verdict"]}
    messages = [{"role": "system", "content": JSON_TURN}, {"role": "user", "content": CAPTION}]
    sent = StructureRequest("r", messages, schema, 64)
    got = structure_request("r", json.loads(json.dumps(structure_payload("m", sent))))  # through the wire
    assert got == sent
    with pytest.raises(ValueError, match="json_schema.schema"):
        structure_request("r", {"messages": messages, "response_format": {"type": "json_schema"}})
