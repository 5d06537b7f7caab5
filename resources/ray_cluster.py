"""The Ray resource: dagster-ray's ``LocalRay`` with Ray's token authentication kept on for the
embedded cluster, and the step's Ray processes bound to the run's life."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
from dagster_ray import LocalRay
from pydantic import Field, PrivateAttr

from resources.lifetime import exit_with_run_process, interruptible, watch_stop_signals
from resources.settings import embedded_ray_auth, ray_temp_root, secrets_forwarded

# The embedded Rays' sessions under ray_temp_root (the `ray up` service's are under "s").
EMBEDDED_TEMP = "e"

# What a worker needs from the step's environment to reach the same stores: object-store endpoint and
# region (volume, tables, model artifacts), the MLflow server, the model hub. Sent by value in the job's
# runtime_env, so a worker node started with a clean environment (a cluster node, a KubeRay pod) reads
# what the step reads.
FORWARDED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
    "MLFLOW_TRACKING_URI",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
)

# Credentials: never sent by value. Ray's runtime-env agent writes a job's whole runtime_env, values
# included, to runtime_env_agent.log on every node. An embedded or `ray up` Ray's workers inherit them
# from the process that started it; a cluster's nodes read their own (a KubeRay pod's env from a
# Kubernetes Secret, an instance role). RAY_FORWARD_SECRETS=1 sends them to a RAY_ADDRESS cluster anyway,
# for nodes that cannot hold credentials, accepting that its nodes' logs carry them (docs/scale-out.md).
SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
)
# Names that mark a variable added through RAY_FORWARD_ENV as a credential too.
_SECRET_MARKERS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "ACCESS_KEY", "PRIVATE")


def is_secret(name: str) -> bool:
    return name in SECRET_ENV or any(m in name.upper() for m in _SECRET_MARKERS)


class EmbeddedRay(LocalRay):
    """An embedded local Ray (or ``RAY_ADDRESS``'s cluster, untouched) for the step that asks for it.

    Embedded, it starts as a loopback node (every Ray socket on 127.0.0.1) with ``RAY_AUTH_MODE=token``
    and this instance's token file (created 0600 under DAGSTER_HOME), which refuses other local users. The step also ends with its run process,
    taking the Ray processes it started with it (``resources/lifetime.py``)."""

    address: str | None = Field(
        default=None,
        description="A local Ray to join instead of embedding one: this instance's `video-assets ray up` service",
    )

    forward_env: list[str] = Field(
        default_factory=lambda: list(FORWARDED_ENV),
        description="Environment variables (names) sent from the step to every Ray worker; values are read "
        "when the step connects and never logged or stored in the run's config. Credentials among them "
        "(SECRET_ENV, or a name with SECRET, TOKEN, PASSWORD, KEY...) are left out unless RAY_FORWARD_SECRETS=1 "
        "with RAY_ADDRESS",
    )

    _session_dir: str | None = PrivateAttr(default=None)
    _run_over: bool = PrivateAttr(default=False)

    def on_connect(self, context) -> None:  # type: ignore[override]
        if self.connected:  # not "connected" when the run was over and nothing was started
            super().on_connect(context)

    @property
    def ray_address(self) -> str | None:  # type: ignore[override]
        return self.address

    @property
    def dashboard_url(self) -> str | None:  # type: ignore[override]
        """The dashboard of the connected Ray as Ray reports it (None without one), not dagster-ray's
        guess from a host and the default port."""
        url = getattr(self._context, "dashboard_url", None) if self._context is not None else None
        return (url if "://" in url else f"http://{url}") if url else None

    def connect(self, context):  # type: ignore[override]
        """dagster-ray's ``connect`` without its ``apply_remote``: that runs a task (starting a worker
        process) only to set Ray Data options there, about 1.5 s of every step here, and Ray Data ships
        the driver's options with each task anyway. An empty ``runtime_env`` is not sent either. The
        ``forward_env`` variables set here go to every worker of the job (``runtime_env.env_vars``), less
        credentials (``SECRET_ENV``). A Ray started here keeps its session under this instance's private temp
        folder (``ray_temp_root``), removed again when the step ends."""
        from dagster_ray.utils import _process_dagster_env_vars

        if self._run_over:
            return None

        options = _process_dagster_env_vars(dict(self.ray_init_options))
        if self.ray_address is None and not os.environ.get("RAY_ADDRESS"):
            options.setdefault("_temp_dir", str(ray_temp_root() / EMBEDDED_TEMP))
        if inject := {**forwarded_env(self.forward_env), **self.get_env_vars_to_inject()}:
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **inject}
            options["runtime_env"] = runtime_env
        self.data_execution_options.apply()
        with interruptible():  # a stop signal, before or during: no Ray is started
            self._context = init_ray(self.ray_address, options)
        if "_temp_dir" in options:  # this step started it: its session folder goes when the step ends
            self._session_dir = (getattr(self._context, "address_info", None) or {}).get("session_dir")
        self.data_execution_options.apply()
        return self._context

    @contextlib.contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Iterator[EmbeddedRay]:
        if exit_with_run_process():  # a step process: a stop signal (from its run) also stops what starts here
            watch_stop_signals(handlers=False)
        self._session_dir = None
        # `dagster job execute` builds its result by initialising every resource again once the run has
        # ended (succeeded, failed, or stopped by a signal): no step runs then, so no Ray is started for it.
        run = context.dagster_run
        self._run_over = run is not None and run.is_finished
        try:
            with embedded_ray_auth(), super().yield_for_execution(context) as resource:
                yield resource
        finally:
            remove_session(self._session_dir)


# Ray Client's server starts one "specific server" process per client; it dies at start now and then (a
# gRPC/fork race: ray-project/ray#63202, open), and the connection fails with this message. A new try gets a
# new process.
CLIENT_START_FAILURE = "Initialization failure from server"
CLIENT_TRIES = 3


def init_ray(address: str | None, options: dict):
    """``ray.init``, with a Ray Client (``ray://``) connection tried again when Ray's server-side process for
    it died at start; a failed Ray Client connection also leaves this process out of client mode (Ray
    leaves it on, and every later Ray call in the process would go through the dead client)."""
    import ray

    client = (address or os.environ.get("RAY_ADDRESS") or "").startswith("ray://")
    for attempt in range(1, CLIENT_TRIES + 1):
        try:
            return ray.init(address=address, **options)
        except Exception as exc:
            if not client:
                raise
            _leave_client_mode(ray)
            if CLIENT_START_FAILURE not in str(exc) or attempt == CLIENT_TRIES:
                raise
            time.sleep(attempt)
    raise AssertionError("unreachable")


def _leave_client_mode(ray) -> None:
    """After a failed Ray Client connection: client mode off again. In client mode ``ray.is_initialized``
    and ``ray.shutdown`` are the Ray Client's: no client connected, so not initialised, and the client's
    shutdown turns client mode off once no client is connected. A Ray this process is connected to
    (client mode was never on) is left alone."""
    if not ray.is_initialized():
        ray.shutdown()


def forwarded_env(names: list[str]) -> dict[str, str]:
    """The set, non-empty variables of ``names`` from this process's environment, credentials left out
    (``is_secret``) unless ``secrets_forwarded()``."""
    send_secrets = secrets_forwarded()
    return {n: os.environ[n] for n in names if os.environ.get(n) and (send_secrets or not is_secret(n))}


def remove_session(session_dir: str | None) -> None:
    """A stopped Ray's session folder (its logs and sockets), when it lies under this instance's private
    temp folder; nothing else is ever removed."""
    if not session_dir:
        return
    path = Path(session_dir).resolve()
    if path.is_relative_to(ray_temp_root().resolve()) and path.name.startswith("session_"):
        shutil.rmtree(path, ignore_errors=True)
        reopen_ray_data_logs(path)


def reopen_ray_data_logs(session: Path) -> None:
    """Ray Data's session log handlers open their file in the session folder on first use and keep it; with
    that folder gone, the next Ray Data job in this process (an in-process run's next step) failed opening it
    (FileNotFoundError from the logger). Closed, each opens the current session's file on its next record; a
    plain file handler into the removed folder is taken off."""
    logger = logging.getLogger("ray.data")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.FileHandler):
            if Path(handler.baseFilename).is_relative_to(session):
                handler.close()
                logger.removeHandler(handler)
        elif not isinstance(handler, logging.StreamHandler):  # Ray Data's SessionFileHandler; the console stays
            handler.close()
