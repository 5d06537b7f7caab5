"""Videos in a bucket: sampling and probing read an S3 object through ranged reads (moto's S3 server
on 127.0.0.1), give the same frames as the local file, and close every stream they open."""

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.fs as pafs
import pytest

from tests.fixtures.processes import free_port
from tests.fixtures.samples import BUNDLED
from video_assets.core.media import source
from video_assets.core.media.sampling import SamplingConfig, SamplingError, sample_video
from video_assets.defs.ingest.assets import probe_file

CLIP = "realshort.mp4"
# Motion and scene-cut passes reopen the source: force both on a short clip.
CFG = SamplingConfig(long_video_s=0.5, scene_split=True, max_frames=8)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A bucket holding one bundled clip; the AWS_* variables point pyarrow at the local server."""
    for k, v in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(k, v)
    name = f"videos-{time.monotonic_ns()}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, allow_bucket_creation=True).create_dir(name)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{name}")
    with fs.open_output_stream(f"{name}/{CLIP}") as out:
        out.write((BUNDLED / CLIP).read_bytes())
    return name


def test_sampling_an_s3_object_gives_the_local_frames(bucket):
    remote = sample_video(f"s3://{bucket}/{CLIP}", CFG)
    local = sample_video(BUNDLED / CLIP, CFG)
    assert remote.decode_stats["motion"] == local.decode_stats["motion"] is not None  # the reopening passes ran
    assert [s.timestamps for s in remote.segments] == [s.timestamps for s in local.segments]
    assert all(np.array_equal(r.frames, lo.frames) for r, lo in zip(remote.segments, local.segments, strict=True))


def test_every_stream_opened_is_closed(bucket, monkeypatch):
    opened = []
    real = source.open_media

    def recording(uri):
        target = real(uri)
        opened.append(target)
        return target

    monkeypatch.setattr(source, "open_media", recording)
    sample_video(f"s3://{bucket}/{CLIP}", CFG)
    assert len(opened) >= 2 and all(s.closed for s in opened)  # the main pass and the motion pass
    opened.clear()
    with pytest.raises(SamplingError, match="cannot open as a media container"):
        sample_video(f"s3://{bucket}/{CLIP}.missing", CFG)
    with pytest.raises(FileNotFoundError):
        real(f"s3://{bucket}/{CLIP}.missing")


def test_probe_reads_the_object(bucket):
    remote = probe_file(f"s3://{bucket}/{CLIP}", (BUNDLED / CLIP).stat().st_size)
    local = probe_file(str(BUNDLED / CLIP), (BUNDLED / CLIP).stat().st_size)
    assert remote.ok and remote == local


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from every thread's /proc children list."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def _stop(proc: subprocess.Popen) -> list[int]:
    """Stop ``proc`` and every process under it, each by PID (children first, so none is re-parented
    and missed; SIGKILL after 20 s); returns the PIDs."""
    pids, frontier = [proc.pid], [proc.pid]
    while frontier:
        kids = _children(frontier.pop())
        pids += kids
        frontier += kids
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in reversed(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids[1:]):
            time.sleep(0.2)
        if not any(_alive(p) for p in pids[1:]):
            break
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def mlflow_server(bucket, s3_endpoint, tmp_path):
    """``mlflow server`` on loopback: runs and registries in SQLite, artifacts proxied into the bucket."""
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    port = free_port()
    # The server writes to the bucket with boto3, which takes the endpoint from AWS_ENDPOINT_URL (set by
    # the bucket fixture): MLflow's own MLFLOW_S3_ENDPOINT_URL is not needed.
    env = dict(os.environ)
    cmd = [
        exe,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{tmp_path}/mlflow.db",
        "--artifacts-destination",
        f"s3://{bucket}/mlartifacts",
    ]
    log = open(tmp_path / "mlflow-server.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever *_proxy says
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited: {(tmp_path / 'mlflow-server.log').read_text()[-2000:]}")
            try:
                with no_proxy.open(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer /health within 90 s")
        yield url
    finally:
        pids = _stop(proc)
        log.close()
        assert proc.poll() is not None
        assert not [p for p in pids if _alive(p)], "an mlflow server process outlived the test"


@pytest.mark.slow
def test_the_whole_graph_on_s3_and_an_mlflow_server(bucket, mlflow_server, instance, tiny_model, tmp_path):
    """Uploads in a bucket, every Delta table in the same bucket, MLflow behind a server whose
    artifacts are in that bucket: sensor -> per-batch graph -> evaluation, all read back from s3://."""
    from dagster import SensorResult, build_sensor_context, materialize
    from dagster_ray.configs import Lifecycle
    from mlflow import MlflowClient

    from resources.delta import DeltaTables
    from resources.mlflow_registry import MlflowRegistry
    from resources.ray_cluster import EmbeddedRay
    from resources.structurer import StructurerSettings
    from resources.vlm import VlmSettings
    from resources.volume import VideoVolume
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.evaluation.assets import eval_scores, golden_set
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.sensors import upload_sensor
    from video_assets.defs.models.assets import CAPTION_PROMPT_FILE, CAPTION_PROMPT_NAME, caption_prompt, vlm_model
    from video_assets.defs.routing.assets import routed_events
    from video_assets.defs.structuring.assets import structured_events

    clips = ["realshort.mp4", "asl_eat.mkv", "bottle-detection.mp4"]
    fs, _ = pafs.FileSystem.from_uri(f"s3://{bucket}")
    for name in clips:
        with fs.open_output_stream(f"{bucket}/videos/{name}") as out:
            out.write((BUNDLED / name).read_bytes())
    res = {
        "volume": VideoVolume(uri=f"s3://{bucket}/videos"),
        "tables": DeltaTables(root_uri=f"s3://{bucket}/tables"),
        "mlflow_registry": MlflowRegistry(
            tracking_uri=mlflow_server, artifact_root="mlflow-artifacts:/video-assets", ui_url=mlflow_server
        ),
        # A fresh cache: the steps must download the registered model back through the server.
        "vlm": VlmSettings(
            model_source=str(tiny_model),
            cache_dir=str(tmp_path / "cache"),
            engine="transformers",
            max_new_tokens=8,
            batch_size=2,
        ),
        "structurer": StructurerSettings(device="cpu"),
        "ray_cluster": EmbeddedRay(ray_init_options={"include_dashboard": False, "num_cpus": 2}),
        "ray_on_demand": EmbeddedRay(ray_init_options={"include_dashboard": False}, lifecycle=Lifecycle(connect=False)),
    }

    tick = upload_sensor(build_sensor_context(instance=instance, resources={k: res[k] for k in ("volume", "tables")}))
    assert isinstance(tick, SensorResult) and len(tick.run_requests) == 1
    for req in tick.dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    key = tick.run_requests[0].partition_key

    assert materialize([vlm_model, caption_prompt, golden_set], instance=instance, resources=res).success
    assert materialize(
        [raw_videos, video_metadata, captions, structured_events, routed_events],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config={"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}},
    ).success
    assert materialize(
        [eval_scores],
        instance=instance,
        resources=res,
        run_config={"ops": {"eval_scores": {"config": {"bootstrap": 20}}}},
    ).success

    # Every table read back from the bucket with polars (delta-rs takes the AWS_* variables).
    def read(name):
        return pl.read_delta(f"s3://{bucket}/tables/{name}", storage_options=options)

    options = {  # explicit options work as well as the environment (polars hands them to delta-rs)
        "aws_endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }

    raw = read("raw_videos")
    assert sorted(raw["uri"].str.split("/").list.last()) == sorted(clips)
    assert all(u.startswith(f"s3://{bucket}/videos/") for u in raw["uri"])
    assert read("video_metadata").height == len(clips)
    caps = read("captions")
    assert caps.filter(pl.col("status") == "ok").height > 0
    events = read("structured_events")
    assert set(events["video_id"]) == set(caps["video_id"]) and events.height == caps.height
    scores = read("eval_scores")
    assert scores.height >= 1

    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    run = client.get_run(scores["mlflow_run_id"][0])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"confusion.png", "scores.json"}
    vlm = res["vlm"]
    version = client.get_model_version_by_alias(vlm.registered_model, vlm.alias)
    assert version.source.startswith("mlflow-artifacts:/")
    stored = [
        f.path
        for f in fs.get_file_info(pafs.FileSelector(f"{bucket}/mlartifacts", recursive=True))
        if f.type == pafs.FileType.File
    ]
    assert any(p.endswith("/model/config.json") for p in stored)
    assert any(p.endswith("/confusion.png") for p in stored)
    # Downloaded once into the models cache (keyed by name, version and artifact), and checked: its
    # SHA256SUMS.json came with it and matches the version's files_sha256 tag.
    [cached] = (tmp_path / "cache" / "registry").glob(f"{vlm.registered_model}-v{version.version}-*")
    assert (cached / ".complete").exists() and any(cached.rglob("SHA256SUMS.json"))
    assert len(version.tags["files_sha256"]) == 64
    prompt = client.load_prompt(f"prompts:/{CAPTION_PROMPT_NAME}@{vlm.alias}")
    assert prompt.template == CAPTION_PROMPT_FILE.read_text().strip()

    # The tables resource's other operations over S3: a missing table, versions, maintenance, deletes.
    tables = res["tables"]
    assert not tables.exists("no_such_table") and tables.version("no_such_table") is None
    assert tables.read("no_such_table").is_empty()
    # The version is the newest commit in the table's log in the bucket, and one write (a delete) adds one.
    log = fs.get_file_info(pafs.FileSelector(f"{bucket}/tables/captions/_delta_log"))
    commits = sorted(int(Path(f.path).stem) for f in log if f.path.endswith(".json"))
    assert commits and tables.exists("captions") and tables.version("captions") == commits[-1], commits
    assert tables.maintain("captions")["table"] == "captions"
    tables.delete("routed_events_probe", "true")  # a missing table: nothing to do
    assert tables.version("routed_events_probe") is None  # and nothing created
    first = raw["video_id"][0]
    before = tables.version("video_metadata")
    tables.delete("video_metadata", f"video_id = '{first}'")
    assert tables.version("video_metadata") == before + 1
    assert first not in set(read("video_metadata")["video_id"]) and read("video_metadata").height == len(clips) - 1
