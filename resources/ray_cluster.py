"""The Ray resource: dagster-ray's ``LocalRay`` with Ray's token authentication kept on for the
embedded cluster, and the step's Ray processes bound to the run's life."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import dagster as dg
from dagster_ray import LocalRay
from pydantic import Field

from resources.lifetime import exit_with_run_process
from resources.settings import embedded_ray_auth

# What a worker needs from the step's environment to reach the same stores: object-store endpoint and
# credentials (volume, tables, model artifacts), the MLflow server and its credentials, the model hub.
# Forwarded by name in the job's runtime_env, so a worker node started with a clean environment (a
# cluster node, a KubeRay pod) reads what the step reads; embedded workers inherit them anyway.
FORWARDED_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "HF_TOKEN",
    "HF_ENDPOINT",
    "HF_HUB_OFFLINE",
)


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
        "when the step connects and never logged or stored in the run's config",
    )

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
        ``forward_env`` variables set here go to every worker of the job (``runtime_env.env_vars``)."""
        from dagster_ray.utils import _process_dagster_env_vars

        options = _process_dagster_env_vars(dict(self.ray_init_options))
        if inject := {**forwarded_env(self.forward_env), **self.get_env_vars_to_inject()}:
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **inject}
            options["runtime_env"] = runtime_env
        self.data_execution_options.apply()
        self._context = init_ray(self.ray_address, options)
        self.data_execution_options.apply()
        return self._context

    @contextlib.contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Iterator[EmbeddedRay]:
        exit_with_run_process()
        with embedded_ray_auth(), super().yield_for_execution(context) as resource:
            yield resource


# Ray Client's server starts one "specific server" process per client; it dies at start now and then (a
# gRPC/fork race: ray-project/ray#63202, open), and the connection fails with this message. A new try gets a
# new process.
CLIENT_START_FAILURE = "Initialization failure from server"
CLIENT_TRIES = 3


def init_ray(address: str | None, options: dict):
    """``ray.init``, with a Ray Client (``ray://``) connection tried again when Ray's server-side process for
    it died at start; a failed Ray Client connection also leaves this process out of client mode (Ray
    leaves it on, and every later ``ray.init`` in the process would go through the dead client)."""
    import ray
    from ray._private.client_mode_hook import _explicitly_disable_client_mode

    client = (address or os.environ.get("RAY_ADDRESS") or "").startswith("ray://")
    for attempt in range(1, CLIENT_TRIES + 1):
        try:
            return ray.init(address=address, **options)
        except Exception as exc:
            if not client:
                raise
            _explicitly_disable_client_mode()
            if CLIENT_START_FAILURE not in str(exc) or attempt == CLIENT_TRIES:
                raise
            time.sleep(attempt)
    raise AssertionError("unreachable")


def forwarded_env(names: list[str]) -> dict[str, str]:
    """The set, non-empty variables of ``names`` from this process's environment."""
    return {name: os.environ[name] for name in names if os.environ.get(name)}
