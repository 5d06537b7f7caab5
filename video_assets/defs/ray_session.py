"""The step's Ray, started or joined only when a stage needs it: the cluster's GPUs and the dashboard link a
materialisation shows. Light on purpose: stages that only place work on Ray (transcripts, embeddings) import
this, not the engines."""

from dagster import MetadataValue


def cluster_gpus() -> float | None:
    """GPUs of the Ray cluster this process is connected to; None when Ray is not started here."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else None


def connect_ray(context, ray_resource) -> float:
    """Start (or join) Ray through a step's on-demand Ray resource, now that a stage needs it; the cluster's
    GPU count. A Ray this process is connected to already is used as it is: in a run whose steps share one
    process (`video-assets demo`, ``execute_in_process``) the run's ``ray_cluster`` joined it at the start
    (the same settings), and ``ray.init`` twice is an error."""
    import ray

    if not ray_resource.connected and not ray.is_initialized():
        ray_resource.connect(context)
    return cluster_gpus() or 0.0


def ray_dashboard(ray_resource) -> dict:
    """``ray_dashboard`` metadata: the URL of the step's Ray dashboard when it has one (RAY_DASHBOARD=1 for
    a Ray this instance starts, on loopback; a cluster's own), nothing when the step did not start Ray."""
    url = ray_resource.dashboard_url if ray_resource.connected else None
    return {"ray_dashboard": MetadataValue.url(url)} if url else {}
