"""A long-lived local Ray for the embedded default (`video-assets ray up`, `make ray-up`): started once
on 127.0.0.1 with this instance's token, joined by every step instead of starting and stopping a Ray
of its own, so Ray's start-up is paid once and caption engines stay loaded between batches (warm
engines, ``warm_engine_idle_s``). Without it, each step embeds its own Ray as before.

Its address lives in ``$DAGSTER_HOME/ray/service.json``; ``video-assets ray down`` stops every process
it started (found by its session folder, like the tests find theirs), nothing else of Ray's."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resources.settings import dagster_home, ensure_ray_auth_token, ray_auth_token_path, ray_token_auth

RAY = str(Path(sys.executable).parent / "ray")


def service_file() -> Path:
    return dagster_home() / "ray" / "service.json"


def _answers(address: str, timeout: float = 0.5) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def service_address() -> str | None:
    """The running service's GCS address, or None (no service, or it is gone)."""
    try:
        info = json.loads(service_file().read_text())
    except (OSError, ValueError):
        return None
    return info["address"] if _answers(info["address"]) else None


def _temp_dir() -> Path:
    # Short and per instance: Ray's unix sockets live under it and their paths are length-limited.
    digest = hashlib.sha256(str(dagster_home()).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"va-ray-{digest}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(num_cpus: int | None = None) -> dict:
    """Start the service unless it runs; returns its address and session folder."""
    if address := service_address():
        return {"address": address, "temp_dir": str(_temp_dir()), "started": False}
    port = _free_port()
    temp = _temp_dir()
    args = [
        RAY,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--temp-dir={temp}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        *([f"--num-cpus={num_cpus}"] if num_cpus else []),
    ]
    with ray_token_auth(ensure_ray_auth_token(ray_auth_token_path())):
        done = subprocess.run(args, env=os.environ.copy(), capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"ray start failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    info = {"address": f"127.0.0.1:{port}", "temp_dir": str(temp), "started_at": time.time()}
    service_file().parent.mkdir(parents=True, exist_ok=True)
    service_file().write_text(json.dumps(info))
    return {**info, "started": True}


def processes(temp_dir: str | None = None) -> list:
    """The service's processes: each Ray process names its session folder on its command line."""
    import psutil

    temp = temp_dir or str(_temp_dir())
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def down(timeout: float = 30.0) -> int:
    """Stop every process of the service; returns how many there were."""
    import psutil

    procs = processes()
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout / 2)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout / 2)
    service_file().unlink(missing_ok=True)
    return len(procs)
