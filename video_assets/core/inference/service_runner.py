"""Ray Data jobs run inside the long-lived local Ray service, not in the step that asks for them.

A step is a new Ray driver, so a job it runs itself is a new Ray job: worker processes started and
the stage code imported again, Ray Data set up again. Measured on 2 CPUs with the tiny model, a
20-clip captions job took 4.5-6.6 s as a new driver's job and about 2 s as the next job of a driver
that had run one before, for 1.4 s of decode + generation. So where the service runs
(`video-assets ray up`, ``resources/ray_service.py``), a step hands its job to a ``JobRunner`` actor
that the service's own driver owns (through ``RunnerFactory``): its workers and Ray Data stay warm
between batches, and the job's rows stream back to the step, which writes them as before. Without the
service (an embedded Ray, or a remote cluster through RAY_ADDRESS), the job runs in the step; through
Ray Client (a Dagster outside the cluster), in a task on the cluster (``on_cluster``).

Kept free of Dagster so it can be driven and tested with plain Ray.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray

NAMESPACE = "video-assets"  # Ray namespace of everything that outlives a step
FACTORY = "job-runner-factory"  # created by the service's driver; its presence means "the service"
RUNNER_IDLE_S = 600.0  # a runner without jobs for this long exits (an old code version's, mostly)
RUNNER_CONCURRENCY = 8  # jobs one runner runs at once (parallel steps)
QUEUED_ROWS = 256  # rows a job's driver task may run ahead of a Ray Client step reading them


def code_version() -> str:
    """A digest of this package's Dagster-free code (what runners and engines execute): a change
    gets new runners and engines, and the old ones expire."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]  # video_assets/core
    for source in sorted(package.rglob("*.py")):
        h.update(source.read_bytes())
    return h.hexdigest()[:12]


class IdleExpiry:
    """An actor that exits by itself after ``idle_s`` without work, giving back its memory (and
    GPU); ``busy`` counts the calls in progress so a long job is never taken for idleness."""

    def _start_expiry(self, idle_s: float) -> None:
        self.last_used = time.monotonic()
        self.busy = 0
        self._busy_lock = threading.Lock()
        threading.Thread(target=self._expire, args=(idle_s,), daemon=True).start()

    def _expire(self, idle_s: float) -> None:
        while True:
            time.sleep(min(idle_s, 5.0))
            if not self.busy and time.monotonic() - self.last_used > idle_s:
                # no_restart: an expiry is not a crash for max_restarts to undo
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def _enter(self) -> None:
        with self._busy_lock:
            self.busy += 1
            self.last_used = time.monotonic()

    def _leave(self) -> None:
        with self._busy_lock:
            self.busy -= 1
            self.last_used = time.monotonic()


class JobRunner(IdleExpiry):
    """Runs generator functions (Ray Data jobs) and streams what they yield to the caller."""

    def __init__(self, idle_s: float):
        self._start_expiry(idle_s)

    def info(self) -> dict:
        import os

        return {"pid": os.getpid(), "busy": self.busy}

    def run(self, fn: Callable[..., Iterator], args: tuple, kwargs: dict) -> Iterator:
        self._enter()
        try:
            yield from fn(*args, **kwargs)
        finally:
            self._leave()


class RunnerFactory:
    """Lives in the service's driver job: the runners it starts belong to that job, so the worker
    processes their jobs use stay up between steps (a step's own job ends with the step)."""

    def __init__(self):
        # Handles kept here: Ray ends an actor whose owner holds no handle to it, and the step that
        # asked for it lets go of its copy when it ends.
        self.runners: dict[str, Any] = {}

    def runner(self, name: str, idle_s: float):
        if name in self.runners:
            try:
                ray.get_actor(name, namespace=NAMESPACE)  # still alive (an idle one exits)
                return self.runners[name]  # the owned handle: replacing it would end the actor
            except ValueError:
                del self.runners[name]
        self.runners[name] = (
            ray.remote(JobRunner)
            .options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=0,  # it waits on its jobs; their tasks and actors hold the resources
                max_concurrency=RUNNER_CONCURRENCY,
            )
            .remote(idle_s)
        )
        return self.runners[name]


def start_factory() -> Any:
    """In the service's driver: the factory steps ask for runners (lives as long as the driver)."""
    return ray.remote(RunnerFactory).options(name=FACTORY, namespace=NAMESPACE, num_cpus=0).remote()


def service_runner(idle_s: float = RUNNER_IDLE_S):
    """The connected cluster's runner for this code version, or None without the service."""
    try:
        factory = ray.get_actor(FACTORY, namespace=NAMESPACE)
    except ValueError:
        return None
    return ray.get(factory.runner.remote(f"job-runner-{code_version()}", idle_s))


def streamed(fn: Callable[..., Iterator], *args, **kwargs) -> Iterator:
    """``fn(*args, **kwargs)`` (a module-level generator function that runs a Ray Data job) inside the
    service's runner when the connected Ray has one, else where the step can drive it (``on_cluster``);
    yields what it yields, as it comes."""
    runner = service_runner()
    if runner is None:
        yield from on_cluster(fn, *args, **kwargs)
        return
    for ref in runner.run.remote(fn, args, kwargs):
        yield ray.get(ref)


def ray_client() -> bool:
    """Whether this process is connected through Ray Client (``ray://``): a Dagster outside the cluster."""
    from ray.util.client import ray as client

    return client.is_connected()


def _drive(queue, fn: Callable[..., Iterator], args: tuple, kwargs: dict) -> None:
    """On the cluster: run the job, each row into ``queue`` as it comes, then the end (or the error)."""
    try:
        for item in fn(*args, **kwargs):
            queue.put(("row", item))
    except Exception as exc:
        queue.put(("error", exc))
        return
    queue.put(("end", None))


def on_cluster(fn: Callable[..., Iterator], *args, **kwargs) -> Iterator:
    """``fn(*args, **kwargs)`` here, or, through Ray Client, in a task on the cluster that drives the job
    there, its rows streaming back through a ``ray.util.queue.Queue``: Ray Data cannot run its executor in
    a Ray Client process (Ray 2.60: "'Worker' object has no attribute 'core_worker'"), and Ray Client has
    no streaming generators."""
    if not ray_client():
        yield from fn(*args, **kwargs)
        return
    from queue import Empty

    from ray.util.queue import Queue

    rows = Queue(maxsize=QUEUED_ROWS, actor_options={"num_cpus": 0})
    # num_cpus=0: it waits on the job, whose own tasks and actors hold the resources.
    done = ray.remote(num_cpus=0, max_retries=0)(_drive).remote(rows, fn, args, kwargs)
    try:
        while True:
            try:
                kind, item = rows.get(timeout=5)
            except Empty:
                if ray.wait([done], timeout=0)[0]:
                    ray.get(done)  # the driver task died (its node lost): raise that
                    if rows.empty():
                        raise RuntimeError("the job's driver task ended without finishing its rows") from None
                continue
            if kind == "error":
                raise item
            if kind == "end":
                return
            yield item
    finally:
        rows.shutdown()
