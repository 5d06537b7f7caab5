"""Credentials never reach a file: a batch captioned on the definitions' own Ray resources (an embedded Ray)
with a canary in every credential the steps could forward leaves no canary in any file of the instance's Ray
temp folder, the Dagster home or the tables, and that temp folder is private (0700) and left empty of
sessions when the step's Ray stops."""

from __future__ import annotations

import logging.config
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

import polars as pl
import pytest
from dagster import asset, materialize
from dagster_ray import RayResource

from resources.mlflow_registry import MlflowRegistry
from resources.ray_cluster import FORWARDED_ENV, SECRET_ENV, forwarded_env, is_secret
from resources.settings import ray_temp_root
from resources.vlm import VlmSettings
from tests.fixtures.samples import copy_samples
from video_assets.defs.partitions import video_batches

RUN_CONFIG = {"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}}
observed: dict = {}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def _holding(files: list[Path], needles: list[str]) -> list[str]:
    found = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        found += [f"{path}: {n}" for n in needles if n.encode() in data]
    return found


@asset(partitions_def=video_batches, deps=["captions"])
def ray_files_probe(ray_cluster: RayResource) -> None:
    """Runs after captions on the same Ray, while its session (logs, the runtime-env agent's log) still exists."""
    session = Path(ray_cluster.context.address_info["session_dir"])
    observed["session"] = session
    observed["files"] = {p: p.read_bytes() for p in _files(session) if p.stat().st_size < 50_000_000}


def test_secret_names_are_never_forwarded_to_a_local_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_FORWARD_SECRETS", "1")  # only ever honoured for a RAY_ADDRESS cluster
    names = [*FORWARDED_ENV, *SECRET_ENV, "ACME_API_TOKEN", "AZURE_STORAGE_ACCESS_KEY"]
    for name in names:
        monkeypatch.setenv(name, f"value-of-{name}")
    sent = forwarded_env(names)
    assert set(sent) == set(FORWARDED_ENV)
    assert all(is_secret(n) for n in [*SECRET_ENV, "ACME_API_TOKEN", "AZURE_STORAGE_ACCESS_KEY"])
    # A remote cluster: the same unless the operator opts in.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("RAY_FORWARD_SECRETS", "0")
    assert set(forwarded_env(names)) == set(FORWARDED_ENV)
    monkeypatch.setenv("RAY_FORWARD_SECRETS", "1")
    assert set(forwarded_env(names)) == set(names)


def test_a_configured_ray_temp_folder_too_long_for_rays_sockets_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("VIDEO_RAY_TEMP_DIR", str(tmp_path / ("x" * 60)))
    with pytest.raises(ValueError, match="VIDEO_RAY_TEMP_DIR"):
        ray_temp_root()
    # A link planted where the folder should be is refused, not followed (a short path: pytest's are too long).
    short = Path(tempfile.mkdtemp(prefix="va", dir="/tmp"))
    try:
        planted = short / "t"
        planted.symlink_to(tmp_path)
        monkeypatch.setenv("VIDEO_RAY_TEMP_DIR", str(planted))
        with pytest.raises(PermissionError, match="not a folder of this user"):
            ray_temp_root()
        planted.unlink()
        assert ray_temp_root() == planted and stat.S_IMODE(planted.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(short)


@pytest.mark.slow
def test_a_batch_leaves_no_credential_in_any_file(
    instance, resources, dagster_home, volume_dir, tiny_model_cache, monkeypatch
):
    from video_assets.definitions import build_resources
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.registration import register_new_files
    from video_assets.defs.models.assets import caption_prompt, vlm_model

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VIDEO_RAY_TEMP_DIR", raising=False)
    tag = uuid.uuid4().hex
    canaries = {name: f"canary-{name.lower()}-{tag}" for name in SECRET_ENV}
    canaries["ACME_API_TOKEN"] = f"canary-acme-{tag}"  # a credential added through RAY_FORWARD_ENV
    monkeypatch.setenv("RAY_FORWARD_ENV", "ACME_API_TOKEN,ACME_REGION")
    for name, value in canaries.items():
        monkeypatch.setenv(name, value)
    # Not a credential: forwarded by value, so it shows where a forwarded value lands.
    region = f"region-{tag}"
    monkeypatch.setenv("ACME_REGION", region)

    built = build_resources()  # the definitions' own Ray resources: an embedded Ray per run
    res = {
        **resources,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{dagster_home}/mlflow.db", artifact_root=str(dagster_home / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), engine="transformers", max_new_tokens=8, batch_size=2),
        "ray_cluster": built["ray_cluster"],
        "ray_on_demand": built["ray_on_demand"],
    }
    copy_samples(volume_dir, ["realshort.mp4", "asl_eat.mkv"])
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    observed.clear()
    result = materialize(
        [raw_videos, video_metadata, captions, vlm_model, caption_prompt, ray_files_probe],
        selection=[raw_videos, video_metadata, captions, ray_files_probe],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config=RUN_CONFIG,
    )
    assert result.success
    caps = pl.read_delta(res["tables"].table_uri("captions"))
    assert (caps["status"] == "ok").sum() >= 2

    root = ray_temp_root()
    session = observed["session"]
    # The run's Ray lived in the instance's private folder, not in Ray's shared default.
    assert session.is_relative_to(root), (session, root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    # While it ran: its logs were there (the runtime-env agent's among them), the forwarded setting in
    # them, and no credential anywhere.
    logs = observed["files"]
    assert any(p.name.startswith("runtime_env_agent") for p in logs), sorted(p.name for p in logs)[:50]
    assert any(region.encode() in data for data in logs.values()), "the forwarded setting reached no log"
    leaked = [f"{p}: {n}" for p, data in logs.items() for n in canaries.values() if n.encode() in data]
    assert not leaked, leaked
    # After: the step's session is gone, and no file under the temp folder, the home or the tables holds one.
    assert not session.exists()
    everything = _files(root) + _files(dagster_home) + _files(Path(res["tables"].root_uri))
    assert len(everything) > 20
    assert not _holding(everything, list(canaries.values()))


def test_a_ray_started_after_a_removed_session_logs_to_its_own(monkeypatch):
    """A step's session folder is removed when its Ray stops; the next Ray this process starts (an in-process
    run's next step) runs its Ray Data jobs with their logs in its own session. Between the two a library
    configures logging as vLLM's and MLflow's imports do (dictConfig closes every handler it knows of and
    forgets them): Ray Data's log file of the removed session was then opened again, failing the job."""
    import ray
    import ray.data

    from resources.ray_cluster import remove_session

    short = Path(tempfile.mkdtemp(prefix="va", dir="/tmp"))
    monkeypatch.setenv("VIDEO_RAY_TEMP_DIR", str(short / "t"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()

    def job() -> Path:
        info = ray.init(num_cpus=1, include_dashboard=False, _temp_dir=str(ray_temp_root()))
        try:
            assert ray.data.range(4).map_batches(lambda b: b).count() == 4
        finally:
            ray.shutdown()
        return Path(info.address_info["session_dir"])

    try:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
        first = job()
        remove_session(str(first))
        assert not first.exists()
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
        second = job()
        assert second != first and (second / "logs" / "ray-data" / "ray-data.log").exists()
    finally:
        shutil.rmtree(short, ignore_errors=True)
