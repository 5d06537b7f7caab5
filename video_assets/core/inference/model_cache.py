"""A model on the node that runs it: each Ray actor (or the Dagster step) resolves the registered
model to a folder on its own machine, downloading the artifact once per node into a node-local cache.
A file lock makes two actors on one node wait for one download instead of both writing the folder."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
from pathlib import Path

COMPLETE = ".complete"  # written last: a folder without it is a download that did not finish


def model_dir(root: Path) -> Path:
    """The folder holding config.json inside a downloaded MLflow transformers model."""
    for candidate in [root / "model", root]:
        if (candidate / "config.json").exists():
            return candidate
    hits = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not hits:
        raise FileNotFoundError(f"no config.json under downloaded model {root}")
    return hits[0].parent


def download_once(artifact_uri: str, target: Path, tracking_uri: str | None = None) -> Path:
    """``artifact_uri`` downloaded into ``target`` exactly once per machine, whoever asks first;
    returns the model folder inside it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if (target / COMPLETE).exists():
        return model_dir(target)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (target / COMPLETE).exists():
            import mlflow.artifacts

            partial = target.parent / f".{target.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            mlflow.artifacts.download_artifacts(
                artifact_uri=artifact_uri, dst_path=str(partial), tracking_uri=tracking_uri
            )
            shutil.rmtree(target, ignore_errors=True)
            partial.rename(target)
            (target / COMPLETE).touch()
    return model_dir(target)


def local_model(model_path: str, artifact_uri: str | None, cache_dir: str, tracking_uri: str | None = None) -> str:
    """``model_path`` when this machine has it (the step's own download, or a shared filesystem);
    else the artifact downloaded into this node's ``cache_dir``."""
    if (Path(model_path) / "config.json").exists():
        return model_path
    if not artifact_uri:
        raise FileNotFoundError(f"model folder {model_path} is not on this node and no artifact URI was given")
    key = hashlib.sha256(artifact_uri.encode()).hexdigest()[:16]
    return str(download_once(artifact_uri, Path(cache_dir) / "node-models" / key, tracking_uri))
