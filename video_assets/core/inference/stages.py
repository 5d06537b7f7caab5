"""The two-stage Ray Data shape every model stage of the archive shares with captioning:

    rows ─► repartition ─► flat_map(cpu_fn, 1-CPU tasks) ─► map_batches(ModelStage actor pool) ─► rows

A wide CPU stage (decode) feeds a narrow pool of actors that each load the model once per job. A row
the CPU stage cannot handle stays in the stream carrying ``error``, and the actor passes it on without
running the model. Retries are bounded for the reasons given in ``core.captioning.job``.

Kept free of Dagster so the stages can be driven and tested with plain Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from video_assets.core.inference.retries import engine_stage_options
from video_assets.core.inference.service_runner import on_cluster

DECODE_TASK_RETRIES = 3  # worker deaths only (OOM kill, lost node): decoding is idempotent


def cpu_task_slots(concurrency: int, engines: int) -> int:
    """CPU tasks (1 CPU each) a job asks Ray Data for: ``concurrency``, but no more than the CPUs of
    the connected cluster that ``engines`` (1 CPU each) leave free. Asking for more than can run makes
    Ray Data queue tasks it counts as running, and the stream stalls (measured on 2 CPUs: a 20-clip
    batch 1.5x slower)."""
    import ray

    from video_assets.core.throughput import decode_workers

    cpus = float(ray.cluster_resources().get("CPU", 0))
    return decode_workers(concurrency, cpus, engines) if cpus else concurrency


@dataclass(frozen=True)
class StageSpec:
    """How wide each stage runs and what the model actors reserve; plain data, shipped to workers."""

    cpu_concurrency: int = 2
    model_concurrency: int = 1
    model_num_gpus: float = 0.0
    batch_size: int = 8
    cpu_resources: dict[str, float] = field(default_factory=dict)
    # 0: the model actors only send to a served model and wait (they hold no engine).
    model_num_cpus: float = 1.0


def stream(
    rows: list[dict],
    cpu_fn: Callable[..., list[dict]] | None,
    cpu_kwargs: dict[str, Any],
    model_stage: type | None,
    model_kwargs: dict[str, Any],
    spec: StageSpec,
) -> Iterator[dict]:
    """Run ``rows`` through ``cpu_fn`` (one input row -> any number of rows; None: no CPU stage) and
    ``model_stage`` (an actor class called with batches; None: no model stage, the CPU stage's rows come
    out as they are); yields the last stage's rows as they come. The job runs here (through Ray Client,
    in a task on the cluster: ``on_cluster``)."""
    if not rows:
        return
    yield from on_cluster(_stream_here, rows, cpu_fn, cpu_kwargs, model_stage, model_kwargs, spec)


def _stream_here(
    rows: list[dict],
    cpu_fn: Callable[..., list[dict]] | None,
    cpu_kwargs: dict[str, Any],
    model_stage: type | None,
    model_kwargs: dict[str, Any],
    spec: StageSpec,
) -> Iterator[dict]:
    import ray.data

    ds = ray.data.from_items(rows)
    if cpu_fn is not None:
        ds = ds.repartition(len(rows)).flat_map(  # one input per block: decoding spreads wide
            cpu_fn,
            fn_kwargs=cpu_kwargs,
            compute=ray.data.TaskPoolStrategy(size=_cpu_slots(spec, model_stage)),
            num_cpus=1,
            max_retries=DECODE_TASK_RETRIES,
            retry_exceptions=False,  # a Python error is already an error row
            **({"resources": spec.cpu_resources} if spec.cpu_resources else {}),
        )
    if model_stage is None:
        yield from ds.iter_rows()
        return
    ds = ds.map_batches(
        model_stage,
        fn_constructor_kwargs=model_kwargs,
        batch_size=spec.batch_size,
        compute=ray.data.ActorPoolStrategy(size=spec.model_concurrency),
        num_gpus=spec.model_num_gpus or None,
        num_cpus=spec.model_num_cpus,
        **engine_stage_options(),  # a poison batch fails the job after bounded retries, never hangs it
    )
    yield from ds.iter_rows()


def _cpu_slots(spec: StageSpec, model_stage: type | None) -> int:
    """CPU tasks beside the model actors (1 CPU each); pinned CPU stages keep ``cpu_concurrency``."""
    if spec.cpu_resources:
        return spec.cpu_concurrency
    return cpu_task_slots(spec.cpu_concurrency, spec.model_concurrency if model_stage is not None else 0)


def node_id() -> str:
    """The Ray node this code runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()


def one_per(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One row per ``keys`` (the last wins): a retried Ray task may deliver its rows twice."""
    return list({tuple(r[k] for k in keys): r for r in rows}.values())


def columns(rows: list[dict]) -> dict[str, list]:
    """A batch (column -> values) from rows that all have the same keys."""
    return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
