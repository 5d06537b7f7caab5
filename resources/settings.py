"""Embedded defaults for every environment variable the product reads.

This is the one module that looks at the environment: it hands Dagster an ``EnvVar`` when the
variable is set (so the UI shows where a value came from) and the embedded default otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

from dagster import EnvVar

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_SAMPLES = REPO_ROOT / "samples"


def dagster_home() -> Path:
    return Path(os.environ.get("DAGSTER_HOME") or REPO_ROOT / "dagster_home").resolve()


def env_or(name: str, default: str) -> str | EnvVar:
    """``EnvVar(name)`` when set and non-empty, else ``default``."""
    return EnvVar(name) if os.environ.get(name) else default


def default_volume_uri() -> str:
    return str(BUNDLED_SAMPLES)


def default_tables_uri() -> str:
    return str(dagster_home() / "tables")


def default_mlflow_uri() -> str:
    return f"sqlite:///{dagster_home() / 'mlflow.db'}"


def default_mlflow_artifacts() -> str:
    return str(dagster_home() / "mlartifacts")


def default_models_dir() -> str:
    return str(dagster_home() / "models")


# The packages a Ray worker needs to run this product's stages (decode tasks, VLM actors).
SHIPPED_PACKAGES = ("video_assets", "resources")


def ray_outlives_steps() -> bool:
    """Whether steps join a Ray cluster that outlives them (engines may then stay warm between batches)."""
    return bool(os.environ.get("RAY_ADDRESS"))


def ray_init_options() -> dict:
    """Embedded Ray: no dashboard (saves a process and a port on a laptop). With RAY_ADDRESS set,
    ray.init connects to that cluster and takes no local-cluster options, but ships this product's
    code to its workers in a ``runtime_env`` (``py_modules``), so a cluster whose image lacks the
    package still runs it; ``RAY_SHIP_CODE=0`` turns that off for images that have it."""
    if os.environ.get("RAY_ADDRESS"):
        if os.environ.get("RAY_SHIP_CODE", "1").strip().lower() in ("0", "false", "no", "off"):
            return {}
        return {"runtime_env": {"py_modules": [str(REPO_ROOT / p) for p in SHIPPED_PACKAGES]}}
    return {"include_dashboard": False}
