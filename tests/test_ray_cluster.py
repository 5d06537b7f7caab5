"""A real two-node Ray cluster on 127.0.0.1 (a head and a worker with its own custom resource),
started by the test with token authentication (a token of its own, 0600): a captions materialisation through RAY_ADDRESS runs its decode stage on the
worker and its VLM actor on the head, with this product's code shipped by the runtime_env. The worker
node starts with a clean environment (as `env -i` would give it: no AWS, MLflow or HF variables), like a
cluster node that is not the Dagster machine: what it needs from the step comes in the runtime_env.
Every process the test starts is stopped by PID."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import psutil
import pytest
from dagster import materialize

from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import EmbeddedRay
from resources.ray_service import ray_init_options
from resources.settings import ensure_secret_file, ray_token_auth
from resources.vlm import VlmSettings
from tests.fixtures.processes import free_port
from tests.fixtures.samples import copy_samples
from video_assets.defs.captioning.assets import captions
from video_assets.defs.ingest.assets import raw_videos, video_metadata
from video_assets.defs.ingest.registration import register_new_files
from video_assets.defs.models.assets import caption_prompt, vlm_model
from video_assets.defs.partitions import video_batches

RAY = str(Path(sys.executable).parent / "ray")


def _cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """Every process of this cluster: each Ray process names its session folder under temp_dir."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def two_node_cluster():
    # A short folder: Ray's unix sockets live under it and their paths are length-limited.
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    port, client_port = free_port(), free_port()
    token = ensure_secret_file(Path(temp_dir) / "auth_token")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_AUTH_TOKEN", None)
    common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    # The worker node: nothing of this process's environment but what Ray itself needs.
    clean = {k: env[k] for k in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    clean |= {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    try:
        subprocess.run(
            [
                RAY,
                "start",
                "--head",
                f"--port={port}",
                f"--ray-client-server-port={client_port}",  # a driver that is not a node: Ray Client
                f"--temp-dir={temp_dir}",
                "--num-cpus=1",
                "--include-dashboard=false",
                "--resources",
                json.dumps({"head_node": 1}),
                *common,
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [
                RAY,
                "start",
                f"--address=127.0.0.1:{port}",
                "--num-cpus=2",
                "--resources",
                json.dumps({"video_worker": 4}),
                *common,
            ],
            env=clean,
            check=True,
            capture_output=True,
            timeout=120,
        )
        # This process's clients (ray.init with RAY_ADDRESS) use the cluster's token too.
        with ray_token_auth(token):
            yield f"127.0.0.1:{port}", temp_dir, f"ray://127.0.0.1:{client_port}"
    finally:
        for proc in _cluster_processes(temp_dir):
            proc.kill()
        deadline = time.monotonic() + 30
        while _cluster_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _cluster_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes still alive: {[p.pid for p in left]}"


def _node_ids(address: str) -> dict[str, str]:
    import ray

    ray.init(address=address)
    try:
        by_resource = {}
        for node in ray.nodes():
            if node["Alive"]:
                for name in ("head_node", "video_worker"):
                    if name in node["Resources"]:
                        by_resource[name] = node["NodeID"]
        return by_resource
    finally:
        ray.shutdown()


def _pinned(resources: dict, tmp_path, tiny_model_cache, max_new_tokens: int, init: dict) -> dict:
    """The step resources of these tests: decode tasks pinned to the worker node, the engine to the head."""
    return {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "a")
        ),
        "vlm": VlmSettings(
            cache_dir=str(tiny_model_cache),
            engine="transformers",
            max_new_tokens=max_new_tokens,
            batch_size=2,
            decode_resources={"video_worker": 1},  # every read of the volume happens on the worker node
            model_resources={"head_node": 1},
        ),
        "ray_cluster": EmbeddedRay(ray_init_options=init),
    }


def _caption_the_volume(instance, res: dict):
    """Register the volume as one batch, the model and prompt, probe it and caption it; the captions
    materialisation's metadata."""
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    assert materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=res).success
    result = materialize(
        [captions, vlm_model, caption_prompt, raw_videos, video_metadata],
        selection=[captions],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config={"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}},
    )
    assert result.success
    return result


@pytest.mark.slow
def test_captions_run_on_both_nodes_with_shipped_code(
    two_node_cluster, instance, resources, volume_dir, tiny_model_cache, tmp_path, monkeypatch
):
    address, _, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    init = ray_init_options()
    shipped = init["runtime_env"]["py_modules"]
    assert {Path(p).name for p in shipped} == {"video_assets", "resources"}

    copy_samples(volume_dir, ["realshort.mp4", "asl_eat.mkv"])
    result = _caption_the_volume(instance, _pinned(resources, tmp_path, tiny_model_cache, 6, init))
    meta = result.asset_materializations_for_node("captions")[0].metadata
    assert meta["error_rows"].value == 0 and meta["rows_written"].value == 2

    nodes = _node_ids(address)
    assert set(nodes) == {"head_node", "video_worker"} and nodes["head_node"] != nodes["video_worker"]
    ran_on = meta["ray_nodes"].value
    assert ran_on == {"decode": [nodes["video_worker"]], "engine": [nodes["head_node"]]}


DRIVER = """
import json, ray
from resources.ray_service import ray_init_options
from resources.settings import ensure_secret_file, ray_token_auth

ray.init(**ray_init_options())

@ray.remote(resources={"video_worker": 1})
def where():
    import resources, video_assets
    return video_assets.__file__, resources.__file__

print(json.dumps(ray.get(where.remote(), timeout=120)))
ray.shutdown()
"""


def test_code_is_shipped_by_the_runtime_env(two_node_cluster, monkeypatch):
    """A worker imports this product from the uploaded py_modules. The driver runs outside the
    checkout, so nothing but the runtime_env can put the checkout's copy on the worker's path."""
    address, temp_dir, _ = two_node_cluster
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_USAGE_STATS_ENABLED": "0"}  # with the fixture's token settings
    out = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=temp_dir, env=env, capture_output=True, text=True, timeout=300, check=True
    )
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert all("runtime_resources" in f and "py_modules_files" in f for f in files), files
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_SHIP_CODE", "0")
    assert "runtime_env" not in ray_init_options()


@pytest.mark.slow
def test_the_model_is_placed_on_every_node(two_node_cluster, tiny_model_cache, tmp_path, monkeypatch):
    """vLLM and Ray's CPU stages open the model by path wherever Ray puts them: the step's folder when
    every node sees it, else the node cache path, the same on every node, whose small files the step
    fetches here to learn the layout (the stages fetch the rest on their nodes: the test below)."""
    import ray

    from resources.vlm import TINY_MODEL_SOURCE
    from video_assets.core.inference.model_cache import ModelFiles, node_cache_path, place_on_every_node

    address, _, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    uri = reg.artifact_uri("captioner", "production")
    nodes = set(_node_ids(address).values())
    ray.init(**ray_init_options())
    try:
        here = str(tiny_model_cache / TINY_MODEL_SOURCE)
        shared = place_on_every_node(ModelFiles(here, uri, str(tmp_path / "cache"), reg.tracking_uri))
        assert shared.path == here and not shared.per_node and shared.nodes == dict.fromkeys(nodes, "present")

        placed = place_on_every_node(ModelFiles("/nonexistent/model", uri, str(tmp_path / "cache"), reg.tracking_uri))
        assert placed.per_node and placed.path.startswith(str(node_cache_path(uri, str(tmp_path / "cache"))))
        assert (Path(placed.path) / "config.json").exists() and not list(Path(placed.path).rglob("*.safetensors"))

        with pytest.raises(FileNotFoundError, match="not on every Ray node and no artifact URI"):
            place_on_every_node(ModelFiles("/nonexistent/model"))
    finally:
        ray.shutdown()


class _OpensTheModel:
    """Stands for Ray Data LLM's stage actors (the vLLM engine, the chat-template stage): opens the model by
    path in its constructor, on whatever node Ray starts it."""

    def __init__(self, path: str):
        import ray

        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"{path}: no model on this node")
        self.names = sorted(p.name for p in Path(path).rglob("*") if p.is_file())
        self.node = ray.get_runtime_context().get_node_id()

    def __call__(self, batch):
        n = len(batch["id"])
        return {"node": [self.node] * n, "names": [json.dumps(self.names)] * n}


def _private_mounts() -> bool:
    """Whether this machine lets a process have mounts of its own (a node with a disk of its own)."""
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def _wait_for_pending_map_actor(job, timeout_s: float = 120) -> None:
    """Until this driver's Ray Data job has a model actor waiting for a node (``PENDING_CREATION``): the job
    is running and its stage cannot be placed yet. Bounded polling on the condition, not a fixed sleep."""
    import ray
    from ray._private import state

    job_id = ray.get_runtime_context().get_job_id()
    deadline = time.monotonic() + timeout_s
    while True:
        actors = state.actors().values()
        if any(
            a["JobID"] == job_id and a["State"] == "PENDING_CREATION" and a["ActorClassName"].startswith("MapWorker(")
            for a in actors
        ):
            return
        assert job.is_alive(), "the job ended before its engine stage waited for the node"
        assert time.monotonic() < deadline, f"no actor of the job waits for a node after {timeout_s} s: {list(actors)}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_that_joins_after_the_step_started_fetches_the_model_for_its_engine(
    two_node_cluster, tiny_model_cache, tmp_path, monkeypatch
):
    """The step places the model (its small files, in the node cache path), starts an engine stage that only
    a node not yet in the cluster can take, and that node joins: with a disk of its own (a private mount of
    the cache folder), its engine actor fetches the whole model itself before opening it. No node but
    the one running the engine holds the weights."""
    import threading

    import ray

    from resources.vlm import TINY_MODEL_SOURCE
    from video_assets.core.inference.model_cache import ModelFiles, on_node_model, place_on_every_node

    if not _private_mounts():  # a container without CAP_SYS_ADMIN: nothing to install that would change it
        pytest.skip("`unshare --mount` is refused here: the late node cannot have a disk of its own")
    address, temp_dir, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    version = reg.resolve_alias("captioner", "production")
    cache = tmp_path / "cache"
    cache.mkdir()
    files = ModelFiles("/nonexistent/model", version.source, str(cache), reg.tracking_uri, version.tags["files_sha256"])

    late = None
    ray.init(**ray_init_options())
    try:
        placed = place_on_every_node(files)
        assert placed.per_node
        ds = ray.data.range(2, override_num_blocks=1).map_batches(
            on_node_model(_OpensTheModel, files, weights=True),
            fn_constructor_kwargs={"path": placed.path},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            resources={"late_node": 1},  # only the node that joins later has it
        )
        rows, errors = [], []

        def run():
            try:
                rows.extend(ds.take_all())
            except Exception as exc:  # reported below, not lost in the thread
                errors.append(exc)

        job = threading.Thread(target=run, daemon=True)
        job.start()
        _wait_for_pending_map_actor(job)  # the job is running, its engine stage waiting for a node
        assert job.is_alive() and not rows and not errors, errors
        # Its own disk for the cache folder: an empty tmpfs over it, seen only by this node's processes.
        late = _join_node(address, resources={"late_node": 1}, private_tmpfs=cache, wait=False)
        job.join(timeout=240)
        assert not errors, errors
        assert len(rows) == 2
        late_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "late_node" in n["Resources"]}
        assert {r["node"] for r in rows} == late_ids and len(late_ids) == 1
        assert "model.safetensors" in json.loads(rows[0]["names"])  # fetched there, whole
        # The step's node (the shared disk) has the small files only: no weights where no engine ran.
        assert not list(cache.rglob("*.safetensors")) and list(cache.rglob("config.json"))
    finally:
        ray.shutdown()
        if late is not None:  # its session stops, and the cluster sees it gone before the next test
            _stop_node(late, address, "late_node")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_served_model_fetches_its_weights_on_its_own_node_and_captions(
    two_node_cluster, tiny_model_cache, tmp_path, monkeypatch
):
    """Served on a cluster, with no copy of the model where the step runs (no shared filesystem): the caption
    application's replica, placed on the worker node, fetches and verifies the registered model there and
    every segment is captioned by it through its route, none by an engine in the job."""
    import ray
    from ray import serve

    from resources.vlm import TINY_MODEL_SOURCE
    from tests.fixtures.samples import BUNDLED
    from video_assets.core.captioning.job import caption_rows
    from video_assets.core.inference.model_cache import ModelFiles, node_cache_path
    from video_assets.core.media.sampling import SamplingConfig
    from video_assets.core.serving.captioner import app_name, stats
    from video_assets.defs.engines import job_spec

    address, _, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)  # a Ray that outlives the steps: the served model
    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    version = reg.resolve_alias("captioner", "production")
    cache = tmp_path / "cache"
    files = ModelFiles("/nonexistent/model", version.source, str(cache), reg.tracking_uri, version.tags["files_sha256"])
    vlm = VlmSettings(
        cache_dir=str(cache), engine="transformers", max_new_tokens=4, batch_size=2, model_resources={"video_worker": 1}
    )
    spec = job_spec(SamplingConfig(min_frames=2, max_frames=3), vlm, "transformers", files, "Describe.")
    assert spec.warm_idle_s > 0 and spec.serve["url"]
    worker = _node_ids(address)["video_worker"]
    assert not list(cache.rglob("model.safetensors"))  # the step fetched no weights
    names = ["realshort.mp4", "asl_eat.mkv"]
    videos = [
        {"video_id": n, "batch_key": "b", "uri": str(BUNDLED / n), "duration_s": None, "rotation": 0} for n in names
    ]
    ray.init(**ray_init_options())
    try:
        rows = list(caption_rows(videos, spec))
        assert sorted(r["video_id"] for r in rows) == sorted(names)
        assert all(r["status"] == "ok" and r["prose"] for r in rows), [r["error"] for r in rows]
        replica = stats(app_name(spec))
        # Every segment answered by the one replica, on the worker node, which loaded the model once.
        assert {r["engine_node"] for r in rows} == {worker} == {replica["node"]}
        assert (replica["loads"], replica["captioned"]) == (1, len(rows))
        # Its weights fetched into that node's cache, checked against the registered manifest.
        assert list(node_cache_path(version.source, str(cache)).rglob("model.safetensors"))
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_vllm_decode_sized_beyond_the_clusters_cpus_takes_a_node_that_joins_mid_job(
    two_node_cluster, tmp_path, monkeypatch
):
    """A vLLM job's decode stage sized by the throughput model (decode CPU s per engine s measured on earlier
    batches) at 6 tasks on a cluster of 3 CPUs at job start (a GPU group that scales from zero has not
    joined yet): the job runs what fits, and a node that joins mid-job decodes part of the batch; nothing
    ties decode to the nodes there when the job was sized. The real decode stage (``decoded_segments``),
    no engine. (The width itself is ``decode_slots``, tested in test_throughput.py.)"""
    import threading

    import ray

    from video_assets.core.captioning.batch import EngineSpec, JobSpec
    from video_assets.core.captioning.job import decode_slots, decoded_segments
    from video_assets.core.inference.model_cache import ModelFiles
    from video_assets.core.media.sampling import SamplingConfig

    address, _, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    copy_samples(tmp_path, ["bottle-detection.mp4"])  # 40 s
    uri = str(tmp_path / "bottle-detection.mp4")
    videos = [
        {"video_id": f"v{i}", "batch_key": "b", "uri": uri, "duration_s": 39.85, "rotation": 0} for i in range(160)
    ]  # about 0.4 s of decode each: the job outlasts the node's start
    files = ModelFiles("/m", "", str(tmp_path), "", "")
    vllm = {"model_source": "/m", "concurrency": 1, "cpu_stage_max_actors": 1}
    spec = JobSpec(SamplingConfig(), EngineSpec("vllm", files), "p", vllm=vllm, cpu_to_accelerator=6.0)
    late = None
    ray.init(**ray_init_options())
    try:
        assert ray.cluster_resources()["CPU"] == 3  # head 1 + worker 2
        assert decode_slots(spec) == 6  # the model's width, beyond today's CPUs (now: 2)
        rows, errors = [], []
        started = threading.Event()

        def run():
            try:
                for row in decoded_segments(videos, spec).iter_rows():
                    rows.append({"video_id": row["video_id"], "decode_node": row["decode_node"]})  # not the frames
                    started.set()
            except Exception as exc:  # reported below, not lost in the thread
                errors.append(exc)
                started.set()

        job = threading.Thread(target=run, daemon=True)
        job.start()
        assert started.wait(120) and not errors, errors
        late = _join_node(address, resources={"late_decode": 1}, wait=False)  # mid-job: takes queued decode tasks
        deadline = time.monotonic() + 300  # a bound, as in _join_node: 120 s was passed once on a loaded machine
        while not any(n["Alive"] and "late_decode" in n["Resources"] for n in ray.nodes()):
            assert time.monotonic() < deadline, "the node did not join"
            time.sleep(0.5)
        assert job.is_alive(), "the job ended before the node joined: give it more videos"
        job.join(timeout=240)
        assert not errors, errors
        assert not job.is_alive() and len({r["video_id"] for r in rows}) == len(videos)
        late_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "late_decode" in n["Resources"]}
        assert len(late_ids) == 1
        assert late_ids & {r["decode_node"] for r in rows}, "the node that joined mid-job decoded nothing"
    finally:
        ray.shutdown()
        if late is not None:
            _stop_node(late, address, "late_decode")


@pytest.mark.slow
def test_a_clean_worker_node_reads_the_bucket_with_the_steps_forwarded_settings(
    two_node_cluster, s3_endpoint, instance, resources, tiny_model_cache, tmp_path, monkeypatch
):
    """Videos in an S3-compatible bucket, decoded on the worker node, whose own environment has no AWS
    variables: the step forwards its endpoint in the job's runtime_env (``forward_env``) and, opted in with
    RAY_FORWARD_SECRETS=1 for nodes that cannot hold credentials, its credentials too (``SECRET_ENV``),
    every segment is captioned, and the secret appears in no log line of the run."""
    import pyarrow.fs as pafs

    from resources.ray_cluster import FORWARDED_ENV, SECRET_ENV
    from resources.volume import VideoVolume
    from tests.fixtures.samples import BUNDLED

    secret = f"secret-{time.monotonic_ns()}"
    aws = {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    assert set(aws) <= set(FORWARDED_ENV) | set(SECRET_ENV)
    monkeypatch.setenv("RAY_FORWARD_SECRETS", "1")
    for k, v in aws.items():
        monkeypatch.setenv(k, v)
    bucket = f"clean-{time.monotonic_ns()}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, allow_bucket_creation=True).create_dir(bucket)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{bucket}")
    clips = ["realshort.mp4", "asl_eat.mkv"]
    for name in clips:
        with fs.open_output_stream(f"{bucket}/videos/{name}") as out:
            out.write((BUNDLED / name).read_bytes())

    address, _, _ = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", address)
    res = _pinned(resources, tmp_path, tiny_model_cache, 4, ray_init_options())
    res["volume"] = VideoVolume(uri=f"s3://{bucket}/videos")
    result = _caption_the_volume(instance, res)
    meta = result.asset_materializations_for_node("captions")[0].metadata
    rows = pl.read_delta(res["tables"].table_uri("captions"))
    assert meta["error_rows"].value == 0, rows.select("uri", "error").rows()
    assert meta["rows_written"].value == len(clips)
    assert meta["ray_nodes"].value["decode"] == [_node_ids(address)["video_worker"]]
    logs = "\n".join(str(e.message) + repr(e.dagster_event) for e in instance.all_logs(result.run_id))
    assert secret not in logs and secret not in repr(instance.get_run_by_id(result.run_id).run_config)


@pytest.mark.slow
def test_a_dagster_outside_the_cluster_runs_the_batch_through_ray_client(
    two_node_cluster, instance, resources, volume_dir, tiny_model_cache, tmp_path, monkeypatch
):
    """The Dagster process is not a Ray node: it connects with Ray Client (``ray://``, the head's client
    server), and the per-batch graph's Ray step runs with its decode tasks on the worker and its engine on
    the head, the code shipped by the runtime_env."""
    _, _, client = two_node_cluster
    monkeypatch.setenv("RAY_ADDRESS", client)
    copy_samples(volume_dir, ["realshort.mp4", "asl_eat.mkv"])
    result = _caption_the_volume(instance, _pinned(resources, tmp_path, tiny_model_cache, 5, ray_init_options()))
    meta = result.asset_materializations_for_node("captions")[0].metadata
    assert meta["error_rows"].value == 0 and meta["rows_written"].value == 2
    nodes = _node_ids(two_node_cluster[0])
    assert meta["ray_nodes"].value == {"decode": [nodes["video_worker"]], "engine": [nodes["head_node"]]}


def test_the_accelerator_pool_follows_the_clusters_gpus(two_node_cluster, dagster_home, monkeypatch, capsys):
    """`video-assets pools --from-cluster` asks the cluster: no GPUs, one model step at a time; a node
    declaring eight GPUs of type H100 joins (Ray's logical GPUs stand in for real ones): eight slots, and none
    of them for engines pinned to another GPU type. The run limit follows (one run more than the slots), read
    back from the instance as a restarted daemon reads it."""
    from dagster import DagsterInstance

    from video_assets.cli import main
    from video_assets.defs.common import ACCELERATOR_POOL

    def limits() -> tuple[int, int]:
        with DagsterInstance.get() as instance:
            slots = instance.event_log_storage.get_concurrency_info(ACCELERATOR_POOL).slot_count
            return slots, instance.get_concurrency_config().run_queue_config.max_concurrent_runs

    address = two_node_cluster[0]
    monkeypatch.setenv("RAY_ADDRESS", address)
    assert main(["pools", "--from-cluster"]) == 0
    assert "cluster GPUs 0" in capsys.readouterr().out and limits() == (1, 2)

    gpu_node = _join_node(address, num_gpus=8, resources={"accelerator_type:H100": 1})
    try:
        assert main(["pools", "--from-cluster"]) == 0
        assert "cluster GPUs 8" in capsys.readouterr().out and limits() == (8, 9)
        assert main(["pools", "--from-cluster", "--accelerator-type", "H100"]) == 0
        assert "cluster GPUs 8 of type H100" in capsys.readouterr().out and limits() == (8, 9)
        assert main(["pools", "--from-cluster", "--accelerator-type", "A100"]) == 0
        assert "cluster GPUs 0 of type A100" in capsys.readouterr().out and limits() == (1, 2)
    finally:
        _stop_node(gpu_node, address, "accelerator_type:H100")
    assert not any(n["Alive"] and "accelerator_type:H100" in n["Resources"] for n in _alive_nodes(address))


class _RecordsItsGpu:
    """A stand-in archive model actor: records where it started and the GPUs Ray gave it, then passes rows on
    once ``expected`` actors have recorded themselves (or ``wait_s`` has passed): the job lasts until every
    actor of the pool is up however slowly the machine starts them, and a pool that never reaches the
    number ends the wait and shows in the count, never a hang."""

    def __init__(self, folder: str, expected: int, wait_s: float = 120):
        import ray

        self.folder, self.expected, self.deadline = Path(folder), expected, time.monotonic() + wait_s
        record = {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()]}
        (self.folder / f"{os.getpid()}.json.part").write_text(json.dumps(record))
        (self.folder / f"{os.getpid()}.json.part").rename(self.folder / f"{os.getpid()}.json")

    def __call__(self, batch):
        while len(list(self.folder.glob("*.json"))) < self.expected and time.monotonic() < self.deadline:
            time.sleep(0.2)
        return batch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_packaged_archive_models_run_four_to_a_gpu(two_node_cluster, tmp_path, monkeypatch):
    """The archive stages' packaged models (Whisper base, MiniLM, the frame encoder) reserve a quarter GPU per
    actor: with one GPU in the cluster (a node declaring one logical GPU joins), the stage's four model
    actors all start on it, sharing GPU 0; at a whole GPU each only one could. The actors hold their rows
    until all four have started (bounded): how fast a loaded machine starts them does not change the count."""
    import ray

    from resources.archive import SPEECH, ArchiveSettings
    from video_assets.core.inference.stages import stream
    from video_assets.core.throughput import cluster_gpus

    address = two_node_cluster[0]
    monkeypatch.setenv("RAY_ADDRESS", address)
    gpu_node = _join_node(address, num_gpus=1, num_cpus=4, resources={"one_gpu": 1})
    records = tmp_path / "actors"
    records.mkdir()
    ray.init(**ray_init_options())
    try:
        archive = ArchiveSettings(cache_dir=str(tmp_path / "models"), concurrency=4)
        spec, device = archive.stage_spec(cluster_gpus(ray.nodes()), batch_size=1, kind=SPEECH)
        assert (device, spec.model_num_gpus, spec.model_concurrency) == ("cuda", 0.25, 4)
        rows = list(
            stream(
                [{"i": i} for i in range(8)], None, {}, _RecordsItsGpu, {"folder": str(records), "expected": 4}, spec
            )
        )
        assert sorted(r["i"] for r in rows) == list(range(8))
        started = [json.loads(p.read_text()) for p in records.iterdir()]
        gpu_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "one_gpu" in n["Resources"]}
        assert len(started) == 4 and {r["node"] for r in started} == gpu_ids
        assert all(r["gpus"] == ["0"] for r in started), started
    finally:
        ray.shutdown()
        _stop_node(gpu_node, address, "one_gpu")


def _join_node(
    address: str,
    num_gpus: int = 0,
    resources: dict | None = None,
    private_tmpfs: Path | None = None,
    wait=True,
    num_cpus: int = 1,
) -> subprocess.Popen:
    """A node joining the cluster now, in a session of its own (``ray start --block``), with a clean
    environment (``private_tmpfs``: an empty tmpfs over that folder, seen by this node's processes only: a
    disk of its own); returns once the cluster lists it (``wait``) or at once."""
    clean = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        **{k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH") if k in os.environ},
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    cmd = [RAY, "start", f"--address={address}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}"]
    cmd += ["--resources", json.dumps(resources or {}), "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    cmd.append("--block")
    if private_tmpfs is not None:
        script = f"mount -t tmpfs tmpfs {private_tmpfs} && exec {' '.join(repr(a) for a in cmd)}"
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    proc = subprocess.Popen(
        cmd, env=clean, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    marker = next(iter(resources or {}), None) if wait else None
    deadline = time.monotonic() + 300  # a bound, not an expectation: a loaded machine starts a node slowly
    while time.monotonic() < deadline:
        if marker is None or any(n["Alive"] and marker in n["Resources"] for n in _alive_nodes(address)):
            return proc
        time.sleep(2)  # each look is a driver's connect
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the node with {resources} did not join")


def _alive_nodes(address: str) -> list[dict]:
    import ray

    ray.init(address=address)
    try:
        return [n for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()


def _stop_node(proc: subprocess.Popen, address: str, marker: str) -> None:
    """Stop a node started by ``_join_node`` (its session), and wait until the cluster sees it gone."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and any(marker in n["Resources"] for n in _alive_nodes(address)):
        time.sleep(1)
