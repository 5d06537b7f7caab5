import os
import shutil
from pathlib import Path

import pytest
from dagster import DagsterInstance

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "samples"
# The full corpus sits beside the repo on developer and CI machines; the bundled subset otherwise.
SHARED_SAMPLES = Path(os.environ.get("VIDEO_SAMPLES_DIR", REPO.parent / "shared" / "samples"))
SAMPLES = SHARED_SAMPLES if (SHARED_SAMPLES / "MANIFEST.csv").exists() else BUNDLED

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; tests use the locally built tiny model
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")


def copy_samples(dest: Path, names: list[str]) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        src = SAMPLES / name
        if not src.exists():
            src = BUNDLED / name
        out.append(Path(shutil.copy(src, dest / name)))
    return out


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
    from resources.volume import VideoVolume

    return {
        "volume": VideoVolume(uri=str(volume_dir), batch_size=50),
        "tables": DeltaTables(root_uri=str(dagster_home / "tables")),
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
