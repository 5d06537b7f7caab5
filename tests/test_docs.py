"""The docs under docs/ stay usable: every ```yaml block parses, docs/scale-out.md names only
environment variables of this project that the code actually reads, and its RayCluster manifest has a
head group and a worker group requesting GPUs."""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SCALE_OUT = DOCS / "scale-out.md"
YAML_BLOCK = re.compile(r"^```ya?ml[^\n]*\n(.*?)^```", re.M | re.S)
# Settings named like this project's own (as opposed to AWS_*, DAGSTER_PG_*, upstream tools' variables).
PROJECT_VAR = re.compile(r"\b((?:VIDEO|VLM|MLFLOW|STRUCTURER)_[A-Z0-9_]+|RAY_ADDRESS)=")


def yaml_blocks(path: Path) -> list[str]:
    return YAML_BLOCK.findall(path.read_text(encoding="utf-8"))


def markdown_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_docs_exist():
    assert SCALE_OUT.is_file()
    assert markdown_files()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_yaml_block_parses(path):
    errors = []
    for number, block in enumerate(yaml_blocks(path), start=1):
        try:
            list(yaml.safe_load_all(block))
        except yaml.YAMLError as exc:
            errors.append(f"{path.relative_to(REPO)} yaml block {number}: {exc}")
    assert not errors, "\n".join(errors)


def source_text() -> str:
    files = [*(REPO / "video_assets").rglob("*.py"), *(REPO / "resources").rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_scale_out_names_only_settings_the_code_reads():
    named = set(PROJECT_VAR.findall(SCALE_OUT.read_text(encoding="utf-8")))
    assert named, "expected VIDEO_*/VLM_*/MLFLOW_*/RAY_ADDRESS settings in docs/scale-out.md"
    src = source_text()
    unread = sorted(name for name in named if f'"{name}"' not in src and f"'{name}'" not in src)
    assert not unread, f"docs/scale-out.md sets variables no code in video_assets/ or resources/ reads: {unread}"


def _ray_clusters() -> list[dict]:
    docs = [d for block in yaml_blocks(SCALE_OUT) for d in yaml.safe_load_all(block)]
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "RayCluster"]


def _requests_gpu(container: dict) -> bool:
    res = container.get("resources") or {}
    return any(int((res.get(k) or {}).get("nvidia.com/gpu", 0)) > 0 for k in ("limits", "requests"))


def test_ray_cluster_manifest_has_a_head_and_a_gpu_worker_group():
    (cluster,) = _ray_clusters()
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["containers"], "head group has no container"
    gpu_groups = [
        g for g in spec["workerGroupSpecs"] if any(_requests_gpu(c) for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups, "no worker group requests nvidia.com/gpu"
    assert all(g["template"]["spec"].get("nodeSelector") for g in gpu_groups), "GPU workers need a node selector"


PROOF = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def test_every_proof_in_the_reliability_doc_exists():
    """docs/reliability.md backs each claim with a test: every test file and function it names exists."""
    text = (DOCS / "reliability.md").read_text(encoding="utf-8")
    named = PROOF.findall(text)
    assert len(named) >= 10
    missing = []
    for path, func in named:
        source = REPO / path
        if not source.is_file():
            missing.append(path)
        elif func and not re.search(rf"^def {func}\(", source.read_text(encoding="utf-8"), re.M):
            missing.append(f"{path}::{func}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
