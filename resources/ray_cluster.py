"""The Ray resource: dagster-ray's ``LocalRay`` with Ray's token authentication kept on for the
embedded cluster, and the step's Ray processes bound to the run's life."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dagster as dg
from dagster_ray import LocalRay
from pydantic import Field

from resources.lifetime import exit_with_run_process
from resources.settings import embedded_ray_auth


class EmbeddedRay(LocalRay):
    """An embedded local Ray (or ``RAY_ADDRESS``'s cluster, untouched) for the step that asks for it.

    Embedded, it starts with ``RAY_AUTH_MODE=token`` and this instance's token file (created 0600
    under DAGSTER_HOME): Ray 2.60's GCS and raylet listen on every interface whatever address they
    are given, so the token is what refuses anyone else. The step also ends with its run process,
    taking the Ray processes it started with it (``resources/lifetime.py``)."""

    address: str | None = Field(
        default=None,
        description="A local Ray to join instead of embedding one: this instance's `video-assets ray up` service",
    )

    @property
    def ray_address(self) -> str | None:  # type: ignore[override]
        return self.address

    def connect(self, context):  # type: ignore[override]
        """dagster-ray's ``connect`` without its ``apply_remote``: that runs a task (starting a worker
        process) only to set Ray Data options there, about 1.5 s of every step here, and Ray Data ships
        the driver's options with each task anyway. An empty ``runtime_env`` is not sent either."""
        import ray
        from dagster_ray.utils import _process_dagster_env_vars

        options = _process_dagster_env_vars(dict(self.ray_init_options))
        if inject := self.get_env_vars_to_inject():
            runtime_env = dict(options.get("runtime_env") or {})
            runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **inject}
            options["runtime_env"] = runtime_env
        self.data_execution_options.apply()
        self._context = ray.init(address=self.ray_address, **options)
        self.data_execution_options.apply()
        return self._context

    @contextlib.contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Iterator[EmbeddedRay]:
        exit_with_run_process()
        with embedded_ray_auth(), super().yield_for_execution(context) as resource:
            yield resource
