"""A long-lived local Ray for the embedded default (`video-assets ray up`, `make ray-up`): started once
with this instance's token, joined by every step instead of starting and stopping a Ray
of its own, so Ray's start-up is paid once and the caption model is served between batches (a Ray Serve
application per model, ``core/serving/captioner.py``, scaled to zero after ``warm_engine_idle_s``).
Without it, each step embeds its own Ray as before.

The service is one Python process, started in a session of its own, that starts Ray the way the
embedded resource does (``ray.init``: a loopback node, token authentication, no Ray Client server, the
dashboard only with RAY_DASHBOARD=1) and
Ray Serve without its HTTP proxy (handles only: no port), and stays its driver. Its address and process id live in
``$DAGSTER_HOME/ray/service.json``; ``video-assets ray down`` stops the service and then every process
left in its session (and any process naming its session folder), nothing else of Ray's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from resources.settings import REPO_ROOT, SHIPPED_PACKAGES, dagster_home, embedded_ray_auth, ray_temp_root, serve_http

START_TIMEOUT_S = 180.0
LOOPBACK = "127.0.0.1"


def service_file() -> Path:
    return dagster_home() / "ray" / "service.json"


def _answers(address: str, timeout: float = 0.5) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def _info() -> dict | None:
    try:
        return json.loads(service_file().read_text())
    except (OSError, ValueError):
        return None


def service_address() -> str | None:
    """The running service's GCS address, or None (no service, or it is gone)."""
    info = _info()
    return info["address"] if info and _answers(info["address"]) else None


def ray_outlives_steps() -> bool:
    """Whether steps join a Ray cluster that outlives them: RAY_ADDRESS's, or this instance's local
    service (`video-assets ray up`). Engines may then stay warm between batches."""
    return bool(os.environ.get("RAY_ADDRESS")) or service_address() is not None


def ray_init_options() -> dict:
    """Embedded Ray: ``local_ray_options`` (the dashboard only when asked for); with this instance's local
    Ray service running (`video-assets ray up`), nothing (the resource joins ``local_ray_address()``).
    With RAY_ADDRESS set,
    ray.init connects to that cluster and takes no local-cluster options, but ships this product's
    code to its workers in a ``runtime_env`` (``py_modules``), so a cluster whose image lacks the
    package still runs it; ``RAY_SHIP_CODE=0`` turns that off for images that have it."""
    if os.environ.get("RAY_ADDRESS"):
        if os.environ.get("RAY_SHIP_CODE", "1").strip().lower() in ("0", "false", "no", "off"):
            return {}
        return {"runtime_env": {"py_modules": [str(REPO_ROOT / p) for p in SHIPPED_PACKAGES]}}
    if local_ray_address():  # this instance's long-lived local Ray: joined as it is (same machine, code)
        return {}
    return local_ray_options()


def dashboard_on() -> bool:
    """RAY_DASHBOARD: whether a Ray this instance starts (embedded, or `video-assets ray up`) runs Ray's dashboard."""
    return os.environ.get("RAY_DASHBOARD", "0").strip().lower() in ("1", "true", "yes", "on")


def local_ray_options() -> dict:
    """``ray.init`` options of a Ray this instance starts: no dashboard (saves a process and a port on a
    laptop) unless RAY_DASHBOARD=1, then Ray's dashboard on 127.0.0.1 (port 8265, or the next free one;
    the steps put its URL in their metadata)."""
    if dashboard_on():
        return {"include_dashboard": True, "dashboard_host": LOOPBACK}
    return {"include_dashboard": False}


def cluster_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster steps connect to, or None (an embedded Ray per step, or the local service)."""
    return os.environ.get("RAY_ADDRESS") or None


def local_ray_address() -> str | None:
    """This instance's long-lived local Ray (`video-assets ray up`) when it runs and RAY_ADDRESS is unset."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    return service_address()


# The service's sessions under the instance's private Ray temp folder (the embedded Rays' are under "e").
SERVICE_TEMP = "s"


def _temp_dir() -> Path:
    # Private (ray_temp_root: 0700) and short: Ray's unix sockets live under it, their paths length-limited.
    return ray_temp_root() / SERVICE_TEMP


def _log_file() -> Path:
    return dagster_home() / "ray" / "service.log"


def up(num_cpus: int | None = None) -> dict:
    """Start the service unless it runs; returns its address and session folder."""
    if address := service_address():
        return {"address": address, "temp_dir": str(_temp_dir()), "started": False}
    service_file().parent.mkdir(parents=True, exist_ok=True)
    service_file().unlink(missing_ok=True)
    args = [sys.executable, "-m", "resources.ray_service", "--temp-dir", str(_temp_dir())]
    args += ["--num-cpus", str(num_cpus)] if num_cpus else []
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with open(_log_file(), "ab") as log:
        proc = subprocess.Popen(
            args, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = _info()
        if info and info.get("pid") == proc.pid and _answers(info["address"]):
            return {**info, "started": True}
        if proc.poll() is not None:
            tail = _log_file().read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the local Ray service exited ({proc.returncode}); {_log_file()}:\n{tail}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # its session: the service and whatever Ray it started
    raise RuntimeError(f"the local Ray service did not start within {START_TIMEOUT_S:.0f} s; see {_log_file()}")


def serve(temp_dir: str, num_cpus: int | None) -> None:
    """The service process: start Ray and Serve, publish the address, wait for SIGTERM."""
    import ray

    from video_assets.core.serving.captioner import start_serve

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with embedded_ray_auth():  # token authentication, as the embedded Ray; its processes inherit it
        # "local": always a new Ray, never one a stale /tmp/ray/ray_current_cluster points at
        ray.init(address="local", num_cpus=num_cpus, _temp_dir=temp_dir, **local_ray_options())
        start_serve(serve_http())  # its HTTP proxy; applications are deployed by the steps that need them
        gcs = ray.get_runtime_context().gcs_address  # 127.0.0.1:port: a loopback node, as the embedded Ray
        info = {"address": gcs, "temp_dir": temp_dir, "pid": os.getpid(), "started_at": time.time()}
        tmp = service_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(service_file())  # readers never see half a file
        print(f"local Ray service up at {gcs} (pid {os.getpid()})", flush=True)
        while not stop:
            time.sleep(0.5)
        from ray import serve

        serve.shutdown()  # the applications' replicas, the controller
        ray.shutdown()  # stops the Ray processes this driver started


def processes(temp_dir: str | None = None, session: int | None = None) -> list:
    """The service's processes: those in its session (it starts in a session of its own, which Ray's
    processes inherit), and any naming its session folder on the command line."""
    import psutil

    temp = temp_dir or str(_temp_dir())
    session = session or (_info() or {}).get("pid")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            names_it = any(part == temp or temp + os.sep in part for part in proc.info["cmdline"] or [])
            if names_it or (session and os.getsid(proc.pid) == session):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    return found


def down(timeout: float = 30.0) -> int:
    """Stop the service (it shuts its Ray down), then every process of it still there; returns how
    many processes there were."""
    import psutil

    procs = processes()
    pid = (_info() or {}).get("pid")
    service = next((p for p in procs if p.pid == pid), None)
    if service is not None:
        try:
            service.send_signal(signal.SIGTERM)
            service.wait(timeout / 2)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
    left = [p for p in procs if p.is_running()]
    for proc in left:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=timeout / 4)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout / 4)
    service_file().unlink(missing_ok=True)
    # Its sessions' logs and sockets: nothing of a stopped service is left in the temp folder.
    shutil.rmtree(_temp_dir(), ignore_errors=True)
    return len(procs)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the long-lived local Ray service (use `video-assets ray up`)")
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--num-cpus", type=int, default=None)
    cli = parser.parse_args()
    serve(cli.temp_dir, cli.num_cpus)
