"""The vLLM settings both model stages build on: what reaches Ray Data LLM's processor config, and
the plans it would silently mangle, refused up front. (vLLM itself does not run here.)"""

import pytest
from dagster import Failure

from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import processor_config
from video_assets.core.media.sampling import SamplingConfig
from video_assets.defs.engines import job_spec


def test_structured_outputs_allow_no_free_whitespace():
    cfg = processor_config(StructurerSettings().vllm_settings("Qwen/Qwen2.5-7B-Instruct"), multimodal=False)
    assert cfg.engine_kwargs["structured_outputs_config"]["disable_any_whitespace"] is True
    assert cfg.engine_kwargs["limit_mm_per_prompt"] == {"image": 0, "video": 0}


def test_default_batches_can_fill_the_engine():
    for settings in (VlmSettings(cache_dir="/tmp").vllm_settings("m"), StructurerSettings().vllm_settings("m")):
        assert settings.batch_size >= settings.max_num_seqs


def test_caption_settings_reach_the_processor():
    vlm = VlmSettings(
        cache_dir="/tmp",
        concurrency=3,
        vllm={
            "accelerator_type": "H100",
            "limit_mm_per_prompt": {"video": 2, "image": 0},
            "max_model_len": 16384,
            "tensor_parallel_size": 2,
        },
    )
    cfg = processor_config(vlm.vllm_settings("/models/qwen"), multimodal=True)
    assert cfg.accelerator_type == "H100"
    assert cfg.engine_kwargs["limit_mm_per_prompt"] == {"video": 2, "image": 0}
    assert cfg.engine_kwargs["max_model_len"] == 16384 and cfg.engine_kwargs["tensor_parallel_size"] == 2
    assert cfg.concurrency == (3, 3)  # the shared concurrency field: vLLM engines, all started with the job


def test_each_stage_has_its_own_defaults_under_the_users_settings():
    caption, text = VlmSettings(cache_dir="/tmp").vllm_settings("m"), StructurerSettings().vllm_settings("m")
    assert (caption.max_model_len, text.max_model_len) == (32768, 8192)
    assert (caption.max_new_tokens, text.max_new_tokens) == (128, 1024)  # each resource's own cap
    mine = StructurerSettings(vllm={"max_model_len": 4096, "batch_size": 8}).vllm_settings("m")
    assert (mine.max_model_len, mine.batch_size, mine.model_source) == (4096, 8, "m")


def test_cpu_stages_scale_beyond_one_actor():
    """Ray's CPU stages would otherwise run as one actor each (the engines' concurrency)."""
    from ray.llm._internal.batch.stages import configs as stage_configs

    kinds = {
        "chat_template_stage": stage_configs.ChatTemplateStageConfig,
        "prepare_multimodal_stage": stage_configs.PrepareMultimodalStageConfig,
        "tokenize_stage": stage_configs.TokenizerStageConfig,
        "detokenize_stage": stage_configs.DetokenizeStageConfig,
    }

    caption = processor_config(VlmSettings(cache_dir="/tmp", vllm={"cpu_stage_max_actors": 6}).vllm_settings("m"))
    text = processor_config(StructurerSettings().vllm_settings("m"), multimodal=False)
    for cfg, stages in (
        (caption, ("chat_template_stage", "prepare_multimodal_stage")),
        (text, ("chat_template_stage", "tokenize_stage", "detokenize_stage")),
    ):
        assert cfg.concurrency == (1, 1)
        for stage in stages:
            resolved = stage_configs.resolve_stage_config(getattr(cfg, stage), kinds[stage], {"concurrency": (1, 1)})
            assert resolved.enabled and resolved.concurrency == ((1, 6) if cfg is caption else (1, 4)), stage


def test_gpu_defaults_and_the_cpu_build_settings_reach_the_processor():
    from video_assets.core.inference.vllm import VllmSettings

    gpu = processor_config(VllmSettings(model_source="m"))
    assert gpu.placement_group_config is None and gpu.log_engine_metrics is True and gpu.runtime_env is None
    cpu = processor_config(
        VllmSettings(
            model_source="m",
            placement_group_config={"bundles": [{"CPU": 1}]},
            log_engine_metrics=False,
            env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"},
        ),
        multimodal=False,
    )
    assert cpu.placement_group_config["bundles"] == [{"CPU": 1, "GPU": 0}] and cpu.log_engine_metrics is False
    assert cpu.runtime_env == {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}


def test_any_engine_setting_can_be_overridden_and_typos_are_refused():
    vlm = VlmSettings(cache_dir="/tmp", vllm={"placement_group_config": {"bundles": [{"CPU": 1}]}})
    assert vlm.vllm_settings("m").placement_group_config == {"bundles": [{"CPU": 1}]}
    text = StructurerSettings(vllm={"max_num_seqs": 8}).vllm_settings("m")
    assert text.max_num_seqs == 8
    bad = VlmSettings(cache_dir="/tmp", vllm={"max_num_seq": 8})
    with pytest.raises(Failure, match="vllm: .*max_num_seq"):
        job_spec(SamplingConfig(), bad, "vllm", ModelFiles("/m"), "describe")


def test_more_frames_than_the_video_loader_keeps_is_refused():
    vlm = VlmSettings(cache_dir="/tmp")
    ok = job_spec(SamplingConfig(max_frames=32), vlm, "vllm", ModelFiles("/m"), "describe")
    assert ok.vllm["max_video_frames"] == 32
    with pytest.raises(Failure, match="max_frames=40 exceeds the 32 frames"):
        job_spec(SamplingConfig(max_frames=40), vlm, "vllm", ModelFiles("/m"), "describe")
    # The transformers engine has no such loader: the same plan is fine there.
    assert (
        job_spec(SamplingConfig(max_frames=40), vlm, "transformers", ModelFiles("/m"), "describe").sampling.max_frames
        == 40
    )


def test_structuring_starts_ray_only_when_vllm_may_run(tiny_model, monkeypatch):
    """The Ray resource is connected for vLLM (asked for, or auto with vLLM installed), never for the
    transformers engine: the CPU default's structuring step does not start Ray."""
    import video_assets.defs.engines as runner
    from video_assets.core.structuring.engines import TransformersStructurer, VllmStructurer

    calls = []

    def connect():
        calls.append(1)
        return 0.0

    engine = runner.make_structurer(StructurerSettings(engine="transformers", device="cpu"), tiny_model, connect)
    assert isinstance(engine, TransformersStructurer) and calls == []
    assert isinstance(runner.make_structurer(StructurerSettings(engine="vllm"), tiny_model, connect), VllmStructurer)
    assert calls == [1]
    monkeypatch.setattr(runner, "vllm_importable", lambda: False)
    runner.make_structurer(StructurerSettings(engine="auto", device="cpu"), tiny_model, connect)
    assert calls == [1]  # auto without vLLM: no Ray
    monkeypatch.setattr(runner, "vllm_importable", lambda: True)
    auto = runner.make_structurer(StructurerSettings(engine="auto", device="cpu"), tiny_model, connect)
    assert calls == [1, 1] and isinstance(auto, TransformersStructurer)  # the cluster has no GPU
