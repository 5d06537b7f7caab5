"""The vLLM caption model as Ray Serve LLM's OpenAI application: one engine that captions, structures, describes
and chats for every step on a Ray that outlives them (`video-assets ray up`, or RAY_ADDRESS's cluster), reached
on the same OpenAI route as every served model (``captioner``) and any endpoint.

    decode tasks (Ray Data) ─► EndpointRequests ─► Serve's HTTP proxy /<app>/v1/chat/completions
        ─► KeyedIngress (Ray Serve LLM's OpenAI ingress) ─► NodeLocalServer (Ray Serve LLM's LLMServer: vLLM)

Ray Serve LLM owns the engine (vLLM's async engine, its health checks, restarts and autoscaling, down to zero
after ``warm_idle_s`` without requests). Each replica fetches and verifies the registered model on its own node
before the engine opens it (``vllm_server.NodeLocalServer``), so no folder is shared between nodes and a Dagster
outside the cluster gets the served model. The steps send the request every engine gets
(``requests.video_chat_body``: one video part, its timing as ``video_metadata``) through the endpoint transport
(``inference.endpoint``: per-request deadline, retries, size cap, one error row per failed request); the route
answers only the instance's serve key.

The application is named by what decides what its engine computes (model files, engine settings, this
code's version): a new model version is a new application, and the old one scales to zero by itself.
With ``warm_idle_s`` 0 (batch mode) engines run inside each job (``vllm_engine.build_vllm_processor_for_job``).

Kept free of Dagster, as ``captioner`` is.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict

from video_assets.core.captioning.batch import EngineSpec, JobSpec
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import VllmSettings, engine_env, engine_kwargs
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.serving.captioner import (
    app_status,
    base_url,
    check_route,
    code_version,
    config_file,
    key_sha256,
    run_once,
)

APP_PREFIX = "vllm-"
SERVER = "NodeLocalServer"  # the engine's deployment class (``vllm_server``), which names its deployment
# VllmSettings of the job's Ray Data stages, not of the engine: one application serves any of them.
JOB_ONLY = frozenset(
    {"batch_size", "frames_in_flight_mb", "cpu_stage_max_actors", "should_continue_on_error", "max_new_tokens"}
)


def app_name(spec: JobSpec) -> str:
    engine = {k: v for k, v in sorted(spec.vllm.items()) if k not in JOB_ONLY}
    h = hashlib.sha256(repr((spec.engine.model, json.dumps(engine, sort_keys=True, default=str))).encode())
    h.update(code_version(__file__).encode())
    return f"{APP_PREFIX}{h.hexdigest()[:12]}"


def deployment_name(app: str) -> str:
    """The engine's deployment, as Ray Serve LLM names it: its class, then the model id (the application's name)."""
    return f"{SERVER}:{app}"


def llm_config(spec: JobSpec, name: str):
    """The ``ray.serve.llm.LLMConfig`` of ``spec``'s engine: the job's vLLM settings (engine arguments,
    placement, accelerator type, workers' environment), 0 to ``concurrency`` replicas, each opening its own
    node's copy of the registered model (``vllm_server.NodeLocalServer``)."""
    from ray.serve.llm import LLMConfig

    from video_assets.core.serving.vllm_server import MODEL_KEY, NodeLocalServer

    settings = VllmSettings(**spec.vllm)
    kwargs = engine_kwargs(settings, multimodal=True)
    # One engine answers captions and structuring: structured outputs without free whitespace (a weak
    # model pads JSON with it to max_tokens), an engine setting in vLLM 0.29, as the in-job structurer's.
    kwargs.setdefault("structured_outputs_config", {"backend": "xgrammar", "disable_any_whitespace": True})
    idle = max(1.0, float(spec.warm_idle_s))
    return LLMConfig(
        model_loading_config={"model_id": name, "model_source": settings.model_source},
        engine_kwargs=kwargs,
        accelerator_type=settings.accelerator_type,
        placement_group_config=settings.placement_group_config,
        runtime_env=engine_env(settings),
        deployment_config={
            "autoscaling_config": {
                "min_replicas": 0,
                "initial_replicas": 1,
                "max_replicas": max(1, settings.concurrency),
                "target_ongoing_requests": settings.max_num_seqs,
                "upscale_delay_s": 0.0,
                "downscale_delay_s": idle,
                "downscale_to_zero_delay_s": idle,
                "look_back_period_s": min(idle, 30.0),
            },
            "max_ongoing_requests": 2 * settings.max_num_seqs,
        },
        log_engine_metrics=settings.log_engine_metrics,
        server_cls=NodeLocalServer,
        experimental_configs={MODEL_KEY: asdict(spec.engine.model)},
    )


def _application(spec: JobSpec, key_digest: str | None = None):
    """``spec``'s OpenAI application (Ray Serve LLM's public builder), bound: what ``deploy`` runs and what
    ``build`` gives ``serve deploy``, so the two cannot differ. ``key_digest``: the serve key's (a config's args
    hold only that), else taken from ``spec.serve``."""
    from ray.serve.llm import build_openai_app

    from video_assets.core.serving.vllm_server import KeyedIngress

    digest = key_sha256(spec.serve.get("api_key", "")) if key_digest is None else key_digest
    return build_openai_app(
        {
            "llm_configs": [llm_config(spec, app_name(spec))],
            "ingress_cls_config": {"ingress_cls": KeyedIngress, "ingress_extra_kwargs": {"key_sha256": digest}},
            # It forwards requests: no CPU held (the engine's replica holds the CPUs or GPUs).
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
        }
    )


def deploy(spec: JobSpec) -> str:
    """The name of ``spec``'s vLLM application, deployed unless it runs already (an earlier step's, or a Serve
    config's: the name says what it computes). The first replica has loaded the model and the route answers
    (``served_endpoint``) when this returns, or a RuntimeError names the settings."""
    name = run_once(app_name(spec), lambda: _application(spec), retire_idle, http=spec.serve)
    check_route(spec, name)
    return name


def served_endpoint(spec: JobSpec) -> dict:
    """``core.inference.endpoint.Endpoint`` fields of ``spec``'s vLLM application's OpenAI route, which takes
    video: what captions, structuring, frame descriptions and chat send to."""
    name = app_name(spec)
    settings = VllmSettings(**spec.vllm)
    return {
        "url": f"{base_url(spec)}/{name}/v1",
        "model": name,
        "api_key": spec.serve.get("api_key", ""),
        "timeout_s": spec.request_timeout_s,
        "batch_size": settings.batch_size,
        "concurrency": callers(settings),
        "video": True,
    }


def callers(settings: VllmSettings) -> int:
    """Ray Data actors that send a job's requests: each sends a batch's rows at once, so enough batches in
    flight to fill every replica's ``max_num_seqs``, twice over so the next is there when one finishes."""
    return 2 * settings.concurrency * max(1, math.ceil(settings.max_num_seqs / settings.batch_size))


BUILDER = f"{__name__}:build"  # a Serve config's import_path


def spec_args(spec: JobSpec) -> dict:
    """What of ``spec`` its application depends on, as plain data (a Serve config's ``args``), with the name
    it computes: ``build`` refuses args edited under that name."""
    return {
        "name": app_name(spec),
        "model": asdict(spec.engine.model),
        "vllm": dict(spec.vllm),
        "idle_s": spec.warm_idle_s,
        "key_sha256": key_sha256(spec.serve.get("api_key", "")),
    }


def build(args: dict):
    """The application builder a Serve config names (``import_path: ...llm:build``): ``spec_args`` back into
    the application the steps deploy themselves, so ``serve deploy`` (or a KubeRay RayService) runs exactly
    it and the steps find it by name."""
    return _application(spec_from_args(args), key_digest=str(args.get("key_sha256") or ""))


def spec_from_args(args: dict) -> JobSpec:
    """``spec_args`` back into a spec. Args whose settings compute another name than theirs are refused: a
    step would otherwise take that engine for the one its name says."""
    spec = JobSpec(
        sampling=SamplingConfig(),
        engine=EngineSpec(name="vllm", model=ModelFiles(**args["model"])),
        prompt="",
        vllm=dict(args["vllm"]),
        warm_idle_s=float(args.get("idle_s", 300.0)),
    )
    if args.get("name") != (name := app_name(spec)):
        raise ValueError(
            f"this Serve config's settings make it application {name}, not {args.get('name')} (edited, or written "
            "by another version of video-assets): write it again with `video-assets ray serve-config`"
        )
    return spec


def serve_config(spec: JobSpec) -> dict:
    """A Serve config file (``serve deploy`` / a RayService's ``serveConfigV2``) holding ``spec``'s vLLM
    application under the name the steps look for, at its route: a step that finds it running uses it as it is."""
    return config_file(app_name(spec), BUILDER, spec_args(spec), http=spec.serve)


def replicas(name: str) -> int:
    """How many replicas of application ``name`` run now (0 when scaled to zero or not deployed)."""
    from ray import serve

    if app_status(name) is None:
        return 0
    deployment = serve.status().applications[name].deployments.get(deployment_name(name))
    return int(deployment.replica_states.get("RUNNING", 0)) if deployment is not None else 0


def retire_idle(keep: str) -> list[str]:
    """Delete the other vLLM applications scaled to zero (another model version, settings or code). One
    with a replica is left to scale down after its idle delay: nothing tells here whether it is answering
    another step's requests. Returns the applications deleted."""
    from ray import serve

    deleted = []
    for other in [n for n in serve.status().applications if n.startswith(APP_PREFIX) and n != keep]:
        try:
            if replicas(other) == 0:
                serve.delete(other, _blocking=True)
                deleted.append(other)
        except Exception:  # gone meanwhile
            continue
    return deleted
