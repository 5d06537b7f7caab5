import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dagster import DagsterInstance

from tests.fixtures import samples
from tests.fixtures.processes import free_port
from tests.fixtures.samples import BUNDLED, CORPUS_SKIP, HAVE_CORPUS, REPO, SAMPLES, SHARED_SAMPLES, copy_samples

# Where the samples live, and the copy that asks by name (tests/fixtures/samples.py: the corpus beside
# the repo when present, else the bundled subset; a corpus-only clip needs @pytest.mark.corpus).
__all__ = ["BUNDLED", "REPO", "SAMPLES", "SHARED_SAMPLES", "copy_samples"]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; tests use the locally built tiny model
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
# The served caption model's route (Serve's HTTP proxy) on a port of this process's own: a second suite, the
# vLLM tests beside it (CI runs them side by side) or another xdist worker starts its own Serve. Set, not
# defaulted: a worker inherits the controller's environment, and Serve's proxy binds with SO_REUSEPORT, so
# two workers' proxies on one port shared its connections (requests answered 404 by the other's proxy).
os.environ["VIDEO_SERVE_PORT"] = str(free_port())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: remember the test (the samples guard asks its marks); skip a test
    marked ``corpus`` when the corpus is absent, and one marked ``network`` when the package index
    cannot be reached (tests/fixtures/network.py)."""
    samples.current_item = item
    if item.get_closest_marker("corpus") is not None and not HAVE_CORPUS:
        pytest.skip(CORPUS_SKIP)
    if item.get_closest_marker("network") is not None:
        from tests.fixtures.network import unreachable_reason

        if reason := unreachable_reason():
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def _ray_data_logs_follow_the_session():
    """Ray Data's file log handler opens ``<session>/logs/ray-data/ray-data.log`` of the first Ray session of
    the process and keeps that path; this process starts many sessions and deletes their folders, so a later
    session's first Ray Data log line would fail its step. After each test the handler is emptied: it opens
    the file of whatever session comes next (what a step process, one session each, does anyway)."""
    yield
    ray_data_logging = sys.modules.get("ray.data._internal.logging")
    if ray_data_logging is None:
        return
    import logging

    for name in ray_data_logging._get_logger_names():
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, ray_data_logging.SessionFileHandler) and handler._handler is not None:
                handler._handler.close()
                handler._handler = None


@pytest.fixture
def dagster_home(tmp_path, monkeypatch) -> Path:
    """A fresh DAGSTER_HOME holding the checked-in dagster.yaml, so the real instance config is used."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


@pytest.fixture
def instance(dagster_home):
    with DagsterInstance.get() as inst:
        yield inst


@pytest.fixture
def volume_dir(tmp_path) -> Path:
    d = tmp_path / "volume"
    d.mkdir()
    return d


@pytest.fixture
def resources(volume_dir, dagster_home):
    from resources.delta import DeltaTables
    from resources.structurer import StructurerSettings
    from resources.volume import VideoVolume

    return {
        "volume": VideoVolume(uri=str(volume_dir), batch_size=50),
        "tables": DeltaTables(root_uri=str(dagster_home / "tables")),
        "structurer": StructurerSettings(),  # captions holds it for its use-case check
    }


@pytest.fixture(scope="session")
def ray_head():
    """One local Ray for the session (tests/fixtures/ray_head.py), started by the first test that asks."""
    from tests.fixtures.ray_head import RayHead

    head = RayHead.start(num_cpus=2)
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture
def session_ray(ray_head, dagster_home, monkeypatch) -> dict:
    """The two Ray resources of the definitions (``ray_cluster``, and ``ray_on_demand`` that connects
    only when asked), joining the session's Ray instead of embedding one each: what a step test
    passes when it wants what runs on Ray, not Ray's start-up."""
    from dagster_ray.configs import Lifecycle

    from resources.ray_cluster import EmbeddedRay

    ray_head.admit(dagster_home)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the address is given; no other cluster's auth
    return {
        "ray_cluster": EmbeddedRay(address=ray_head.address),
        "ray_on_demand": EmbeddedRay(address=ray_head.address, lifecycle=Lifecycle(connect=False)),
    }


@pytest.fixture(scope="session")
def tiny_model_cache(tmp_path_factory) -> Path:
    """A models cache holding the tiny random Qwen2.5-VL, built once per test session: the only build
    of the default tiny model. Session-scoped, so shared by every test: read it, never modify it
    (a test that needs to change a model copies it first)."""
    from resources.vlm import TINY_MODEL_SOURCE
    from tests.fixtures.tiny_models import build_tiny_vlm

    cache = tmp_path_factory.mktemp("models")
    build_tiny_vlm(cache / TINY_MODEL_SOURCE)
    return cache


@pytest.fixture(scope="session")
def tiny_model(tiny_model_cache) -> Path:
    """The tiny model's folder inside ``tiny_model_cache`` (where ``VlmSettings`` looks for it)."""
    from resources.vlm import TINY_MODEL_SOURCE

    return tiny_model_cache / TINY_MODEL_SOURCE


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible server on loopback for this module; stopped by PID."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("moto_server is not installed (dev extra: moto[server])")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("moto_server did not start within 30 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
