"""Where a step's Ray Data job runs: in the step (it is the job's driver), or, through Ray Client (a
Dagster outside the cluster), in a task on the cluster that drives it there (``on_cluster``).

Kept free of Dagster so it can be driven and tested with plain Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import ray

QUEUED_ROWS = 256  # rows a job's driver task may run ahead of a Ray Client step reading them


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
