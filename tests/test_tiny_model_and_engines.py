"""The offline tiny Qwen2.5-VL, the transformers caption engine on it, and the vLLM request shaping.

No network, no GPU, no vLLM: the model is built locally from random weights; the vLLM side is only
config building and row shaping (the GPU run happens on clusters).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from video_assets.core.captioning.requests import CaptionRequest, CaptionResponse, VideoChat, build_messages
from video_assets.core.inference import choose_engine_name
from video_assets.core.models.tiny_vlm import MARKER, TINY_MODEL_NAME, WARNING, build_tiny_qwen25_vl

PROMPT = "Describe what the people and their hands do."


def frames(n: int, h: int = 56, w: int = 56, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def request(rid: str, n: int, step: float = 1.0, **kw) -> CaptionRequest:
    return CaptionRequest(rid, frames(n, seed=n), [round(i * step, 3) for i in range(n)], PROMPT, **kw)


# ``tiny_model`` (tests/conftest.py): the session's one build of the tiny model, shared read-only.


@pytest.fixture(scope="session")
def engine(tiny_model):
    from video_assets.core.captioning.transformers_engine import TransformersEngine

    started = time.perf_counter()
    eng = TransformersEngine(str(tiny_model), device="cpu", batch_size=4, max_new_tokens=8)
    print(f"\nengine loaded in {time.perf_counter() - started:.1f}s")
    return eng


# -- the tiny model -------------------------------------------------------------------------------


def test_tiny_model_is_labelled_small_and_idempotent(tiny_model, tmp_path):
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["_name_or_path"] == TINY_MODEL_NAME
    assert WARNING in cfg["_tiny_test_model_warning"]
    assert "TINY RANDOM TEST MODEL — outputs are nonsense" in (tiny_model / "README.md").read_text(encoding="utf-8")
    assert cfg["model_type"] == "qwen2_5_vl"
    vision = cfg["vision_config"]
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (14, 2, 2)
    assert cfg["text_config"]["num_hidden_layers"] == 2 and vision["depth"] == 2
    size = sum(p.stat().st_size for p in tiny_model.rglob("*") if p.is_file())
    assert size < 8 * 2**20, f"tiny model is {size / 2**20:.1f} MiB"

    # Rebuilding is tried on a copy: the session's model is shared by other tests and stays untouched.
    copy = Path(shutil.copytree(tiny_model, tmp_path / TINY_MODEL_NAME))
    weights = copy / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_qwen25_vl(copy) == copy
    assert weights.stat().st_mtime_ns == before, "a complete build was rebuilt"

    # An incomplete folder (marker lost, e.g. a crashed build) is rebuilt, not trusted.
    (copy / MARKER).unlink()
    assert build_tiny_qwen25_vl(copy) == copy
    assert (copy / MARKER).is_file()
    assert (copy / "model.safetensors").stat().st_mtime_ns != before
    # The rebuild is deterministic: the same weights as the session's build.
    assert (copy / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()


def test_the_vllm_variant_has_32_wide_heads_and_a_video_processor_file(tiny_model, tmp_path):
    from tests.fixtures.tiny_models import build_tiny_vlm_for_vllm

    with pytest.raises(ValueError, match="variant"):
        build_tiny_qwen25_vl(tmp_path / "x", text_config={"num_attention_heads": 2})
    folder = build_tiny_vlm_for_vllm(tmp_path / "vllm")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32
    assert 2 * sum(text["rope_parameters"]["mrope_section"]) == 32
    video = json.loads((folder / "video_preprocessor_config.json").read_text())
    assert video == json.loads((folder / "processor_config.json").read_text())["video_processor"]
    assert not (tiny_model / "video_preprocessor_config.json").exists(), "the demo model is unchanged"


def test_tiny_model_loads_with_auto_classes_and_wires_special_tokens(tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    tok = processor.tokenizer
    assert 500 <= len(tok) <= 1100
    model = AutoModelForImageTextToText.from_pretrained(tiny_model)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    cfg = model.config
    ids = tok.convert_tokens_to_ids
    assert cfg.video_token_id == ids("<|video_pad|>") == processor.video_token_id
    assert cfg.image_token_id == ids("<|image_pad|>")
    assert cfg.vision_start_token_id == ids("<|vision_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert ids("<|im_end|>") in model.generation_config.eos_token_id
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"):
        assert tok(t, add_special_tokens=False).input_ids == [ids(t)], f"{t} is split"
    # The real Qwen2-VL chat template: image and video parts become their placeholders.
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>hi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# -- messages ------------------------------------------------------------------------------------


def test_build_messages_one_video_part_with_timestamps_in_text():
    req = CaptionRequest("r", frames(3), [12.0, 12.5, 13.25], PROMPT, system="You caption videos.")
    messages = build_messages(req)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == [{"type": "text", "text": "You caption videos."}]
    parts = [p for m in messages for p in m["content"]]
    videos = [p for p in parts if p["type"] == "video"]
    assert len(videos) == 1 and not any(p["type"] == "image" for p in parts)
    assert videos[0]["video"] is req.frames and videos[0]["timestamps"] == [12.0, 12.5, 13.25]
    assert videos[0]["fps"] == pytest.approx(2 / 1.25)
    (text,) = [p["text"] for p in parts if p["type"] == "text" and p["text"] != "You caption videos."]
    assert "Frames sampled at 12.0s, 12.5s, 13.25s" in text and text.endswith(PROMPT)
    assert [m["role"] for m in build_messages(request("n", 2))] == ["user"]  # no system turn unless asked


def test_chat_template_renders_one_video_placeholder(engine):
    text = engine.processor.apply_chat_template(
        build_messages(request("r", 4)), tokenize=False, add_generation_prompt=True
    )
    assert text.count("<|vision_start|><|video_pad|><|vision_end|>") == 1
    assert "<|image_pad|>" not in text and "Frames sampled at 0.0s, 1.0s, 2.0s, 3.0s" in text


# -- the transformers engine ---------------------------------------------------------------------


def test_transformers_engine_two_requests_different_frame_counts(engine):
    assert engine.name == "transformers"
    reqs = [request("eight", 8), request("four", 4)]
    out = engine.generate(reqs)
    assert [r.request_id for r in out] == ["eight", "four"]
    for r in out:
        assert isinstance(r, CaptionResponse)
        assert r.error is None
        assert r.text.strip()
        assert 0 < r.output_tokens <= 8
        assert r.latency_s > 0
    # 8 frames of 56x56 -> 4 temporal x 2x2 merged = 16 video tokens; 4 frames -> 8; plus longer timestamps text.
    assert out[0].input_tokens > out[1].input_tokens
    assert out[0].input_tokens - out[1].input_tokens >= 8


def test_batched_generation_matches_one_by_one(engine):
    reqs = [request("a", 8), request("b", 4, system="Be brief.")]
    batched = engine.generate(reqs)
    single = [engine.generate([r])[0] for r in reqs]
    assert [(r.text, r.input_tokens, r.output_tokens) for r in batched] == [
        (r.text, r.input_tokens, r.output_tokens) for r in single
    ]


def test_video_metadata_sets_qwen_temporal_spacing(engine):
    reqs = [request("one_fps", 4, step=1.0), request("two_fps", 4, step=0.5)]
    inputs = engine.prepare([VideoChat.of(r) for r in reqs])
    # Qwen2.5-VL: second_per_grid_ts = temporal_patch_size / fps of the sampled frames.
    assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2.0, 1.0])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4], [2, 4, 4]]
    assert engine.processor.tokenizer.padding_side == "left"
    assert (inputs["attention_mask"][:, -1] == 1).all()


def test_malformed_request_fails_alone(engine):
    empty = CaptionRequest("empty", np.zeros((0, 56, 56, 3), np.uint8), [], PROMPT)
    out = engine.generate([request("good", 4), empty])
    assert [r.request_id for r in out] == ["good", "empty"]
    assert out[0].error is None and out[0].text and out[0].output_tokens > 0
    assert out[1].error and "shape" in out[1].error
    assert (out[1].text, out[1].input_tokens, out[1].output_tokens) == ("", 0, 0)


def test_batch_failure_is_retried_one_by_one(engine):
    # Valid-looking frames the Qwen processor rejects (aspect ratio > 200): the whole batch raises,
    # then each request is retried alone.
    sliver = CaptionRequest("sliver", np.zeros((2, 1, 300, 3), np.uint8), [0.0, 1.0], PROMPT)
    out = engine.generate([request("good", 4), sliver, request("also_good", 2)])
    assert [r.request_id for r in out] == ["good", "sliver", "also_good"]
    assert out[0].error is None and out[0].text and out[2].error is None and out[2].text
    assert out[1].error and "aspect ratio" in out[1].error and out[1].text == ""


# -- vLLM config and request shaping (no vLLM here) ----------------------------------------------


def test_vllm_processor_config_carries_the_settings():
    from pydantic import ValidationError
    from ray.data.llm import vLLMEngineProcessorConfig

    from video_assets.core.captioning.vllm_engine import VllmSettings, build_processor_config

    settings = VllmSettings(
        model_source="Qwen/Qwen2.5-VL-7B-Instruct",
        tensor_parallel_size=2,
        gpu_memory_utilization=0.85,
        max_num_seqs=32,
        max_model_len=16384,
        concurrency=3,
        batch_size=8,
    )
    config = build_processor_config(settings)
    assert isinstance(config, vLLMEngineProcessorConfig)
    assert config.model_source == "Qwen/Qwen2.5-VL-7B-Instruct"
    ek = config.engine_kwargs
    assert ek["tensor_parallel_size"] == 2
    assert ek["gpu_memory_utilization"] == 0.85
    assert ek["max_num_seqs"] == 32
    assert ek["max_model_len"] == 16384
    assert ek["limit_mm_per_prompt"] == {"video": 1, "image": 0}  # one video part per request, no images
    assert (config.batch_size, config.concurrency) == (8, (3, 3))  # 3 engines from the start
    assert config.should_continue_on_error is True
    assert config.prepare_multimodal_stage["enabled"] is True  # vLLM parses the video part
    # Whatever the defaults are, they reach the engine unchanged; extra engine_kwargs override them.
    defaults = VllmSettings(model_source="m")
    ek = build_processor_config(defaults).engine_kwargs
    for name in ("tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "max_model_len"):
        assert ek[name] == getattr(defaults, name), name
    overridden = build_processor_config(VllmSettings(model_source="m", engine_kwargs={"max_num_seqs": 2}))
    assert overridden.engine_kwargs["max_num_seqs"] == 2
    # The frames queued per engine fit frames_in_flight_mb: 64 segments of 16 decoded 448x448 frames (9.6 MB)
    # a batch, 4096 MB -> 6 batches at once, and Ray Data sends no more than that.
    segment_mb = 16 * 448 * 448 * 3 / 1e6
    bounded = build_processor_config(VllmSettings(model_source="m", batch_size=64), segment_mb)
    assert (bounded.max_concurrent_batches, bounded.max_tasks_in_flight_per_actor) == (6, 6)
    held = bounded.max_concurrent_batches * 64 * segment_mb
    assert held <= 4096 < (bounded.max_concurrent_batches + 1) * 64 * segment_mb
    small = VllmSettings(model_source="m", batch_size=64, frames_in_flight_mb=100)
    assert build_processor_config(small, segment_mb).max_concurrent_batches == 1  # never 0
    assert build_processor_config(defaults).max_concurrent_batches == 8  # Ray's default when no plan is known
    # Impossible settings are refused before any engine starts.
    for bad in ({"gpu_memory_utilization": 1.5}, {"tensor_parallel_size": 0}, {"batch_size": 0}):
        with pytest.raises(ValidationError):
            VllmSettings(model_source="m", **bad)


def test_to_vllm_row_shapes_openai_messages_with_one_video():
    from PIL import Image

    from video_assets.core.captioning.vllm_engine import ERROR_KEY, REQUEST_ID_KEY, to_vllm_row

    req = CaptionRequest("vid:3", frames(4, 56, 84), [10.0, 10.5, 11.0, 11.5], PROMPT, system="sys", max_new_tokens=300)
    row = to_vllm_row(req, max_new_tokens=256)
    assert row[REQUEST_ID_KEY] == "vid:3" and row[ERROR_KEY] == ""
    assert row["sampling_params"] == {"max_tokens": 256, "temperature": 0.0}
    # The timing travels as the video metadata the transformers engine builds, not as a bare fps kwarg.
    meta = row["mm_processor_kwargs"]["video_metadata"]
    assert row["mm_processor_kwargs"]["do_sample_frames"] is False
    assert meta == {
        "total_num_frames": 4,
        "fps": pytest.approx(2.0),
        "duration": pytest.approx(2.0),
        "frames_indices": [0, 1, 2, 3],
    }
    assert set(to_vllm_row(CaptionRequest("bad", frames(1, 8, 8)[0], [0.0], PROMPT))["mm_processor_kwargs"]) == set(
        row["mm_processor_kwargs"]
    )  # an error row keeps the schema
    system, user = row["messages"]
    assert system == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    assert user["role"] == "user"
    videos = [p for p in user["content"] if p["type"] == "video_url"]
    texts = [p["text"] for p in user["content"] if p["type"] == "text"]
    assert len(videos) == 1 and len(user["content"]) == 2
    assert "Frames sampled at 10.0s, 10.5s, 11.0s, 11.5s" in texts[0] and texts[0].endswith(PROMPT)
    url = videos[0]["video_url"]["url"]
    prefix = "data:video/jpeg;base64,"
    assert url.startswith(prefix)
    decoded = [Image.open(io.BytesIO(base64.b64decode(b))) for b in url[len(prefix) :].split(",")]
    assert [(im.format, im.size) for im in decoded] == [("JPEG", (84, 56))] * 4
    json.dumps(row)  # plain data: travels through Ray Data / Arrow
    assert to_vllm_row(req)["sampling_params"]["max_tokens"] == 300
    # The CPU stage's JPEGs go into the URL as they are: not decoded and encoded again.
    from dataclasses import replace

    from video_assets.core.media.frames import encode

    jpegs = encode(frames(4, 56, 84))
    url = to_vllm_row(replace(req, frames=jpegs))["messages"][1]["content"][0]["video_url"]["url"]
    assert [base64.b64decode(b) for b in url[len(prefix) :].split(",")] == jpegs
    assert "timestamps" in to_vllm_row(replace(req, frames=jpegs[:3]))[ERROR_KEY]  # 3 frames, 4 times


def test_vllm_rows_round_trip_to_responses():
    from video_assets.core.captioning.vllm_engine import ERROR_KEY, REQUEST_ID_KEY, from_vllm_row, to_vllm_row

    bad = to_vllm_row(CaptionRequest("bad", np.zeros((0, 56, 56, 3), np.uint8), [], PROMPT))
    assert bad[ERROR_KEY] and "shape" in bad[ERROR_KEY]  # marked so every Ray stage skips it
    resp = from_vllm_row(bad)
    assert (resp.request_id, resp.text, resp.output_tokens) == ("bad", "", 0) and resp.error == bad[ERROR_KEY]

    # What Ray's vLLM stage leaves on a row (its own integer "request_id" beside ours).
    ok = {
        REQUEST_ID_KEY: "vid:0",
        "request_id": 7,
        "generated_text": " A person picks up a cup. ",
        "num_input_tokens": 812,
        "num_generated_tokens": 9,
        "time_taken_llm": 0.42,
        ERROR_KEY: "",
    }
    assert from_vllm_row(ok) == CaptionResponse("vid:0", "A person picks up a cup.", 812, 9, 0.42, None)


def test_choose_engine_name(monkeypatch):
    import video_assets.core.inference as engines

    # Whatever this machine has: auto picks vLLM only where it is importable and a GPU is visible.
    here = "vllm" if engines.vllm_importable() and engines.cuda_visible() else "transformers"
    assert choose_engine_name(None) == choose_engine_name("auto") == choose_engine_name(" AUTO ") == here
    assert choose_engine_name("transformers") == "transformers"
    assert choose_engine_name("vllm") == "vllm"  # explicit: may run on cluster GPUs this process can't see
    with pytest.raises(ValueError):
        choose_engine_name("tensorrt")
    monkeypatch.setattr(engines, "vllm_importable", lambda: True)
    monkeypatch.setattr(engines, "cuda_visible", lambda: False)
    assert choose_engine_name("auto") == "transformers"  # vLLM alone is not enough: needs a GPU
    monkeypatch.setattr(engines, "cuda_visible", lambda: True)
    assert choose_engine_name("auto") == "vllm"
    monkeypatch.setattr(engines, "vllm_importable", lambda: False)
    assert choose_engine_name(None) == "transformers"
    # With a cluster's GPU count, whether vLLM imports is asked of the cluster (has_vllm), only when it has GPUs.
    assert choose_engine_name("auto", gpus=8, has_vllm=lambda: True) == "vllm"
    monkeypatch.setattr(engines, "vllm_importable", lambda: True)  # this process has it: beside the point
    assert choose_engine_name("auto", gpus=8, has_vllm=lambda: False) == "transformers"

    def never():
        raise AssertionError("asked without GPUs")

    assert choose_engine_name("auto", gpus=0, has_vllm=never) == "transformers"
