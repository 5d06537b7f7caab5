"""The caption model served on a Ray that outlives the steps, behind one OpenAI route whatever runs it:
``captioner`` (transformers, this project's Serve deployment) or ``llm`` (vLLM, Ray Serve LLM's OpenAI
application). The one place that picks between them; every step then sends to ``endpoint(spec)`` as to any
OpenAI-compatible endpoint. Imports are lazy: the serving code loads only where a model is served."""

from __future__ import annotations


def _module(spec):
    if spec.engine.name == "vllm":
        from video_assets.core.serving import llm

        return llm
    from video_assets.core.serving import captioner

    return captioner


def deploy(spec) -> str:
    """The served application of ``spec``, deployed unless it runs; its route answers when this returns."""
    return _module(spec).deploy(spec)


def endpoint(spec) -> dict:
    """``inference.endpoint.Endpoint`` fields of the served application's OpenAI route."""
    return _module(spec).served_endpoint(spec)


def deployment(spec, app: str) -> str:
    """The deployment of application ``app`` whose replicas hold the engine."""
    return _module(spec).deployment_name(app)


def replicas(spec, app: str) -> int:
    """Replicas of ``app``'s engine running now (0 when scaled to zero or not deployed)."""
    return _module(spec).replicas(app)


def engine_service(spec, served_app: str | None = None) -> dict:
    """Where a captions job's engine ran, for its materialisation: an endpoint, the served application (the
    one the job deployed, ``served_app``) and its replicas now, or the job's own engines."""
    if spec.engine.name == "endpoint":  # the URL and model only: never the key
        return {
            "mode": "endpoint",
            "url": spec.endpoint["url"],
            "model": spec.endpoint["model"],
            # what each segment was sent as (``endpoint_engine.caption_payload``), and why
            "request": "one video part (VLM_ENDPOINT_VIDEO)"
            if spec.endpoint.get("video")
            else "image parts, times in the text (the endpoint takes no video: VLM_ENDPOINT_VIDEO off)",
        }
    if spec.served:  # the caption model's application, on its route
        name = served_app or _module(spec).app_name(spec)
        return {
            "mode": "served",
            "application": name,
            "deployment": deployment(spec, name),
            "replicas": replicas(spec, name),
        }
    return {"mode": "in-job", "engine": spec.engine.name, "actors": spec.vlm_concurrency}
