"""GPU sizing from configuration: engine concurrency, tensor parallelism, GPU memory share, max_num_seqs,
accelerator type and the request timeout set from the environment (what a sensor-launched run, which takes
no run config, gets); the in-job engines all started with the job, not a pool autoscaling from one; and
the vLLM `env_vars` setting added to the variables the step forwards, not put in their place."""

import pytest
import ray
from dagster import Failure

from resources.vlm import VlmSettings
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import processor_config
from video_assets.core.media.sampling import SamplingConfig
from video_assets.definitions import build_resources
from video_assets.defs.engines import job_spec

SIZING = {
    "VLM_CONCURRENCY": "8",
    "VLM_TENSOR_PARALLEL_SIZE": "2",
    "VLM_GPU_MEMORY_UTILIZATION": "0.85",
    "VLM_MAX_NUM_SEQS": "32",
    "VLM_ACCELERATOR_TYPE": "H100",
    "VLM_REQUEST_TIMEOUT_S": "600",
}


def _vlm(monkeypatch, **env) -> VlmSettings:
    """The definitions' `vlm` resource under ``env``, its variables resolved as a run resolves them."""
    for name in SIZING:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_resources()["vlm"].process_config_and_initialize()


def test_engine_sizing_comes_from_the_environment(monkeypatch):
    vlm = _vlm(monkeypatch, **SIZING)
    spec = job_spec(SamplingConfig(), vlm, "vllm", ModelFiles("/models/qwen"), "Describe.")
    assert spec.vlm_concurrency == 8
    cfg = processor_config(vlm.vllm_settings("/models/qwen"))
    engine = cfg.engine_kwargs
    assert (engine["tensor_parallel_size"], engine["gpu_memory_utilization"], engine["max_num_seqs"]) == (2, 0.85, 32)
    assert cfg.accelerator_type == "H100"
    # Eight engines from the start: a fixed pool, not Ray Data LLM's pool autoscaling from one for an int.
    assert cfg.get_concurrency(autoscaling_enabled=True) == {"min_size": 8, "max_size": 8}
    assert vlm.endpoint({"url": "http://127.0.0.1:8000/v1", "model": "m"})["timeout_s"] == 600.0

    # Unset: the defaults, and the `vllm` mapping still sizes what the variables leave unset.
    default = _vlm(monkeypatch)
    assert (default.concurrency, default.endpoint_timeout_s) == (1, 120.0)
    mapped = default.model_copy(update={"vllm": {"tensor_parallel_size": 4, "accelerator_type": "A100"}})
    settings = mapped.vllm_settings("m")
    assert (settings.tensor_parallel_size, settings.accelerator_type, settings.max_num_seqs) == (4, "A100", 64)


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("VLM_CONCURRENCY", "eight", "valid integer"),
        ("VLM_CONCURRENCY", "0", "greater than or equal to 1"),
        ("VLM_TENSOR_PARALLEL_SIZE", "1.5", "valid integer"),
        ("VLM_GPU_MEMORY_UTILIZATION", "90", "less than or equal to 1"),
        ("VLM_MAX_NUM_SEQS", "-4", "greater than or equal to 1"),
        ("VLM_REQUEST_TIMEOUT_S", "0", "greater than 0"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(monkeypatch, name, value, why):
    with pytest.raises(ValueError, match=rf"^{name}='{value}' \(sets VlmSettings\.\w+\): .*{why}"):
        _vlm(monkeypatch, **{name: value})


def test_a_variable_and_the_vllm_mapping_that_disagree_are_refused(monkeypatch):
    vlm = _vlm(monkeypatch, VLM_TENSOR_PARALLEL_SIZE="2")
    same = vlm.model_copy(update={"vllm": {"tensor_parallel_size": 2}})
    assert same.vllm_settings("m").tensor_parallel_size == 2
    other = vlm.model_copy(update={"vllm": {"tensor_parallel_size": 4}})
    with pytest.raises(
        Failure, match=r"tensor_parallel_size is 2 \(vlm.tensor_parallel_size, VLM_TENSOR_PARALLEL_SIZE\)"
    ):
        job_spec(SamplingConfig(), other, "vllm", ModelFiles("/m"), "describe")


@pytest.fixture
def own_ray(dagster_home):
    """A Ray of this test's own (the product's embedded kind: loopback, token authentication); ``start`` takes
    ``ray.init``'s options."""
    from resources.settings import embedded_ray_auth

    ray.shutdown()  # an earlier in-process step may have left this process connected to its Ray
    with embedded_ray_auth():
        yield lambda **options: ray.init(include_dashboard=False, **options)
        ray.shutdown()


def test_auto_asks_a_gpu_node_of_the_cluster_whether_vllm_is_there(own_ray, monkeypatch):
    """VLM_ENGINE=auto with Dagster outside the cluster: the step's own packages say nothing about the GPU
    workers'. Here the step process claims vLLM and the cluster (a loopback node declaring 2 GPUs, whose
    workers run this environment, without vLLM) has none: auto is transformers, decided on the GPU node."""
    import video_assets.core.inference as inference
    import video_assets.defs.engines as engines

    monkeypatch.setattr(inference, "vllm_importable", lambda: True)  # this process "has" vLLM
    own_ray(num_cpus=1, num_gpus=2)
    assert engines.cluster_gpus() == 2.0
    assert engines.cluster_has_vllm() is False
    assert engines.engine_name(VlmSettings(cache_dir="/tmp", engine="auto")) == "transformers"


def test_auto_structuring_asks_the_cluster_the_steps_join_not_this_process(own_ray, monkeypatch, tiny_model):
    """STRUCTURER_ENGINE=auto with Dagster outside the cluster (RAY_ADDRESS) and no vLLM in this process: the
    cluster is still asked (its GPU workers may have vLLM); here its GPU node has none, so transformers."""
    from resources.structurer import StructurerSettings
    from video_assets.core.inference import vllm_importable
    from video_assets.core.inference.model_cache import ModelFiles
    from video_assets.defs.engines import cluster_gpus, make_structurer

    assert not vllm_importable()  # .venv: the step process has no vLLM
    own_ray(num_cpus=1, num_gpus=2)
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)  # steps join this cluster
    asked = []

    def connect_ray():
        asked.append(True)
        return cluster_gpus()

    structurer = make_structurer(StructurerSettings(engine="auto"), ModelFiles(str(tiny_model)), connect_ray)
    assert asked == [True] and structurer.name == "transformers"


def test_vllm_env_vars_extend_what_the_step_forwards_to_a_served_engine(own_ray, monkeypatch):
    """Ray Serve LLM sets a replica's runtime_env to the caller's with the engine's keys over it: an
    ``env_vars`` of the engine's own would drop the forwarded stores, MLflow and hub variables. (The served
    application's ``llm_config`` takes ``engine_env``; building it needs vLLM, `make test-vllm-cpu`.)"""
    from resources.ray_cluster import FORWARDED_ENV, forwarded_env
    from video_assets.core.inference.vllm import VllmSettings, engine_env

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-a-runtime-env")
    monkeypatch.delenv("RAY_FORWARD_SECRETS", raising=False)
    # What the step's Ray resource sends its job (``EmbeddedRay.connect``): credentials left out.
    forwarded = forwarded_env([*FORWARDED_ENV, "AWS_SECRET_ACCESS_KEY"])
    assert (
        forwarded["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000" and "AWS_SECRET_ACCESS_KEY" not in forwarded
    )
    own_ray(num_cpus=1, runtime_env={"env_vars": forwarded})
    mine = VllmSettings(model_source="m", env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert engine_env(mine) == {"env_vars": {**forwarded, "VLLM_CPU_KVCACHE_SPACE": "1"}}
    assert engine_env(VllmSettings(model_source="m")) == {"env_vars": forwarded}
    # The engine's own value wins over a forwarded one of the same name.
    over = VllmSettings(model_source="m", env_vars={"MLFLOW_TRACKING_URI": "file:///x"})
    assert engine_env(over)["env_vars"]["MLFLOW_TRACKING_URI"] == "file:///x"


# Short bundled clips, one segment each; repeated under other video ids to make the batch.
CLIPS = ("realshort.mp4", "asl_eat.mkv", "carphone_distorted.mp4", "chaplin.mp4")
GPUS = 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_engines_each_on_one_gpu_for_a_batch_of_fewer_batches(own_ray, monkeypatch, tiny_model):
    """On a node of 8 (logical) GPUs with VLM_CONCURRENCY=8, a 16-clip batch's in-job engines are 8 actors of
    one GPU each, all started before the first row is written although its 4 batches would keep only 4 busy
    (the transformers engine computes on the CPU; Ray hands out the GPU ids all the same)."""
    from tests.fixtures.samples import clip
    from video_assets.core.captioning.job import caption_rows

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # in-job engines: no Ray that outlives the step
    own_ray(num_cpus=GPUS + 2, num_gpus=GPUS)  # a CPU for each engine actor, two for decoding
    vlm = _vlm(monkeypatch, VLM_CONCURRENCY=str(GPUS))
    # The resource's batch_size (4): 16 segments are 4 batches for 8 engines, so a pool that grew with the work
    # from 1 would not hold all 8 GPUs (measured: 6 at the first row).
    vlm = vlm.model_copy(update={"device": "cpu", "num_gpus": 1.0, "max_new_tokens": 2})
    sampling = SamplingConfig(min_frames=2, max_frames=2, max_pixels=112 * 112, screen=None)
    spec = job_spec(sampling, vlm, "transformers", ModelFiles(str(tiny_model)), "Describe.")
    assert (spec.vlm_concurrency, spec.vlm_num_gpus, spec.warm_idle_s) == (GPUS, 1.0, 0.0)

    videos = [
        {"video_id": f"v{i:02d}", "batch_key": "b", "uri": str(clip(CLIPS[i % 4])), "duration_s": None, "rotation": 0}
        for i in range(16)
    ]
    rows = caption_rows(videos, spec)
    try:
        first = next(rows)
        # Only the engine actors ask for GPUs, one each: every GPU held means 8 engines, each on its own GPU id,
        # all started before the first row (the job waits for its pools: Ray Data places a fixed pool's actors
        # without waiting, and a loaded machine saw 5 or 6 of 8 at the first row, the rest never needed).
        held = ray.cluster_resources()["GPU"] - ray.available_resources().get("GPU", 0.0)
        assert held == GPUS
        got = [first, *rows]
    finally:
        rows.close()  # a job left running would start a Ray of its own after the test's is shut down
    assert sorted(r["video_id"] for r in got) == [v["video_id"] for v in videos]
    assert all(r["status"] == "ok" for r in got), [(r["video_id"], r["error"]) for r in got if r["status"] != "ok"]
