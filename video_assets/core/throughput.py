"""A throughput model of the captioning job: characterise small, predict large.

From per-stage costs measured on a small run (the ``captions`` asset's ``cost_breakdown``: the job's
fixed start-up, decode CPU seconds per second of video, engine seconds per request, requests per
second of video), predict the wall time of N hours of video on a given number of decode workers and
engines, which stage bounds it, the CPU:accelerator ratio, and the decode concurrency that keeps the
engines fed. The job is a two-stage stream, so its steady state runs at the slower stage's rate;
the start-up and the first item's pass through the faster stage are paid once.

Pure: no Dagster, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    startup_s: float  # per step: Ray (or joining it), actors, model load, first batch
    decode_cpu_s_per_video_s: float  # CPU seconds of decode + sample per second of video
    engine_s_per_request: float  # engine busy seconds per segment request
    requests_per_video_s: float  # segment requests per second of video
    other_s: float = 0.0  # per step: Delta, model resolution, Dagster
    # Per request, serial, outside both stages: the hand-off of each row to the step, its log line and
    # its share of the writes; and, with a CPU engine, the stages slowing each other on shared cores.
    per_request_s: float = 0.0

    @property
    def cpu_to_accelerator(self) -> float:
        """Decode CPU seconds per engine second (inf without engine time): the CPU:accelerator ratio."""
        engine_per_video_s = self.engine_s_per_request * self.requests_per_video_s
        return self.decode_cpu_s_per_video_s / engine_per_video_s if engine_per_video_s else math.inf

    @classmethod
    def from_run(cls, cost: dict, video_s: float, requests: int, cpu_workers: int = 1, engines: int = 1) -> StageCosts:
        """Costs from one captions materialisation (its ``cost_breakdown`` metadata, the seconds of video
        it captioned, the requests it sent) made with ``cpu_workers`` decode tasks at once and
        ``engines`` engines. The fixed cost is what the run's wall time leaves once its stream is
        accounted for, so the model reproduces the run it was calibrated on."""
        return cls.from_runs([(cost, video_s, requests)], cpu_workers, engines)

    @classmethod
    def stage_rates(cls, runs: list[tuple[dict, float, int]]) -> StageCosts:
        """The two stages' rates from the totals of ``runs`` ``(cost_breakdown, video_s, requests)``, no fixed
        costs (what ``from_runs`` fits those on)."""
        if not runs or any(v <= 0 or r <= 0 for _, v, r in runs):
            raise ValueError("a calibration run needs captioned video (video_s > 0, requests > 0)")
        video = sum(v for _, v, _ in runs)
        reqs = sum(r for _, _, r in runs)
        return cls(
            startup_s=0.0,
            decode_cpu_s_per_video_s=sum(c["busy_s"]["decode_cpu"] for c, _, _ in runs) / video,
            engine_s_per_request=sum(c["busy_s"]["generation"] for c, _, _ in runs) / reqs,
            requests_per_video_s=reqs / video,
        )

    @classmethod
    def from_runs(cls, runs: list[tuple[dict, float, int]], cpu_workers: int = 1, engines: int = 1) -> StageCosts:
        """Costs from several materialisations ``(cost_breakdown, video_s, requests)`` on the same
        hardware. Stage rates come from their totals; what each run's wall time leaves once its stream
        is accounted for is split into a fixed part and a per-request part by a least-squares line
        (two runs of different sizes or more; one run: all fixed, as ``from_run``)."""
        per_stage = cls.stage_rates(runs)
        points = [(r, c["wall_s"]["total"] - predict(per_stage, v, cpu_workers, engines).wall_s) for c, v, r in runs]
        startup, per_request = _line(points)
        return cls(
            startup_s=startup,
            decode_cpu_s_per_video_s=per_stage.decode_cpu_s_per_video_s,
            engine_s_per_request=per_stage.engine_s_per_request,
            requests_per_video_s=per_stage.requests_per_video_s,
            per_request_s=per_request,
        )


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope (both >= 0) of the least-squares line through ``points``; a flat line
    through their mean when they cannot fix a slope."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if n < 2 or sxx == 0:
        return max(0.0, my), 0.0
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    return max(0.0, my - slope * mx), slope


@dataclass(frozen=True)
class Prediction:
    wall_s: float
    decode_s: float  # the decode stage's share of the wall time at this concurrency
    engine_s: float  # the engines' share
    bound_by: str  # "decode" | "engine"
    cpu_to_accelerator: float  # decode CPU seconds per engine second
    best_cpu_workers: int  # decode workers that keep `engines` busy (more only wait)


def decode_workers(cpu_concurrency: int, cluster_cpus: float, engines: int, cpus_per_engine: float = 1.0) -> int:
    """Decode tasks that really run at once: Ray schedules a 1-CPU task only on a CPU no engine holds."""
    free = int(cluster_cpus - engines * cpus_per_engine)
    return max(1, min(cpu_concurrency, free))


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval: the wall time an engine had a request in flight. Summing
    vLLM's latencies counts each second once per overlapping request (up to max_num_seqs times)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def vllm_decode_workers(cpu_concurrency: int, cluster_cpus: float, engines: int, cpu_stage_actors: int) -> int:
    """Decode tasks beside vLLM: every CPU of the cluster that its engines (1 CPU each) and Ray's CPU stages
    (chat template, multimodal parsing: up to ``cpu_stage_actors`` actors of 1 CPU) leave, and never fewer
    than ``cpu_concurrency``. vLLM's engines sit on GPUs, so decode is what a GPU node's CPUs are for: a
    fixed width (2) starved an 8-GPU node's engines."""
    return max(cpu_concurrency, int(cluster_cpus - engines - cpu_stage_actors))


def decode_width(now: int, cpu_to_accelerator: float | None, engines: int) -> int:
    """The most decode tasks a vLLM job runs at once: ``now`` (what the cluster's CPUs leave at job start,
    ``vllm_decode_workers``) raised to the width that keeps ``engines`` engines busy by the throughput
    model (``cpu_to_accelerator``: decode CPU seconds per engine second, measured on this engine's earlier
    batches; None before any). Ray Data's budget runs only as many as the CPUs of the moment allow, so the
    rest is demand: an autoscaling cluster adds CPU for it, and nodes that join mid-job (a GPU group scaling
    from zero) take decode tasks; a cluster that cannot grow runs ``now`` of them. Never below ``now``: a
    calibration from smaller hardware must not starve today's engines."""
    if cpu_to_accelerator is None or not math.isfinite(cpu_to_accelerator) or cpu_to_accelerator <= 0:
        return now
    return max(now, math.ceil(engines * cpu_to_accelerator))


def calibrated_cpu_to_accelerator(runs: list[tuple[dict, float, int]]) -> float | None:
    """The ratio ``predict`` reports (``StageCosts.cpu_to_accelerator``) calibrated on ``runs``
    ``(cost_breakdown, video_s, requests)``; None without usable runs or engine time."""
    try:
        ratio = StageCosts.stage_rates(runs).cpu_to_accelerator
    except ValueError:  # no runs, or none that captioned video
        return None
    return ratio if math.isfinite(ratio) else None


def cluster_gpus(nodes: list[dict], accelerator_type: str | None = None) -> float:
    """GPUs of the alive nodes (``ray.nodes()``), only those of ``accelerator_type`` when given (Ray's
    ``accelerator_type:<T>`` node resource, what vLLM's ``accelerator_type`` setting places engines by):
    an engine pinned to H100s cannot use the cluster's other GPUs."""
    key = f"accelerator_type:{accelerator_type}" if accelerator_type else None
    return float(
        sum(
            n["Resources"].get("GPU", 0)
            for n in nodes
            if n.get("Alive") and (key is None or key in n.get("Resources", {}))
        )
    )


def accelerator_slots(cluster_gpus: float, gpus_per_step: int) -> int:
    """Model steps that can hold their engines at once on a cluster: one per ``gpus_per_step`` GPUs, at
    least one (a CPU cluster still runs one model step at a time)."""
    return max(1, int(cluster_gpus // max(1, gpus_per_step)))


def run_limit(slots: int) -> int:
    """Batch runs at once for ``slots`` accelerator slots: one more than the slots, so a run in its CPU stages
    (registration, probing, decode) overlaps those holding engines; 2 for the laptop's single slot."""
    return max(1, slots) + 1


def predict(costs: StageCosts, video_s: float, cpu_workers: int, engines: int = 1) -> Prediction:
    """Wall time of captioning ``video_s`` seconds of video with ``cpu_workers`` decode tasks in
    parallel and ``engines`` engines."""
    if cpu_workers < 1 or engines < 1:
        raise ValueError("need at least one decode worker and one engine")
    decode_total = costs.decode_cpu_s_per_video_s * video_s
    requests = costs.requests_per_video_s * video_s
    engine_total = costs.engine_s_per_request * requests
    decode_s = decode_total / cpu_workers
    engine_s = engine_total / engines
    slower, faster = max(decode_s, engine_s), min(decode_s, engine_s)
    # Fill/drain: the first item crosses the faster stage before the slower one is busy.
    per_item = faster / max(1.0, requests)
    wall = costs.startup_s + costs.other_s + slower + per_item + costs.per_request_s * requests
    ratio = costs.cpu_to_accelerator if engine_total else math.inf
    best = max(1, math.ceil(engines * ratio)) if math.isfinite(ratio) else 1
    return Prediction(wall, decode_s, engine_s, "decode" if decode_s >= engine_s else "engine", ratio, best)
