"""The caption model as a Ray Serve application: one loaded engine that captions and structures for
every step on a Ray that outlives them (`video-assets ray up`, or RAY_ADDRESS's cluster).

    decode tasks (Ray Data) ─► served_captions (0-CPU caller tasks) ─► Serve handle ─► CaptionerReplica

Serve owns the replicas: it starts one on the first request, routes every step's batches to it, starts
another when requests queue (up to the job's ``vlm_concurrency``), replaces one that dies, and stops the
last after ``idle_s`` without requests (scale to zero), giving back its memory and GPU. An application is
named by everything that decides what its engine computes (model files, device, limits, this code's
version), so a new model version is a new application and the old one scales to zero by itself.

Kept free of Dagster so it can be driven and tested with plain Ray.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import threading
import time
import uuid
from dataclasses import asdict

import numpy as np
import ray

from video_assets.core.captioning.batch import EngineSpec, JobSpec, build_engine, caption_batch, node_id
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.retries import VLM_BATCH_RETRIES
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.sources import module_digest

APP_PREFIX = "captioner-"
DEPLOYMENT = "Captioner"
# Requests one replica holds at once: the next batch is there when one finishes (Serve queues the rest
# at the caller and starts another replica when they pile up).
IN_FLIGHT = 2
LIVE = ("RUNNING", "DEPLOYING", "UPSCALING", "DOWNSCALING")  # an application's states while it serves


@functools.cache  # the code a process runs does not change under it
def code_version(module: str = __file__) -> str:
    """A digest of the code a served application runs (``module``'s import closure: the engine, the model
    cache, sampling...): a change to it gets a new application, and the old one scales to zero. An edit
    anywhere else (routing, scoring, the UI) deploys nothing."""
    return module_digest(module)


def app_name(spec: JobSpec) -> str:
    h = hashlib.sha256(repr((spec.engine, spec.vlm_num_gpus, sorted(spec.vlm_resources.items()))).encode())
    h.update(code_version().encode())
    return f"{APP_PREFIX}{h.hexdigest()[:12]}"


class CaptionerReplica:
    """One replica: the engine loaded once, then every caption batch and structuring request of every
    step. One generation at a time (a second would only share the same cores or GPU); ``stats`` answers
    while one runs."""

    def __init__(self, engine: EngineSpec, app: str | None = None):
        if app is not None:  # a config whose name and settings disagree would serve another model by that name
            from ray import serve

            running = serve.get_replica_context().app_name
            if running != app:
                raise RuntimeError(
                    f"this caption application is named {running!r}, but its settings make it {app!r}: steps "
                    "would take it for another model or code version. Write the Serve config again with "
                    "`video-assets ray serve-config` and deploy it unchanged"
                )
        started = time.perf_counter()
        self.engine = build_engine(engine)
        self.max_new_tokens = engine.max_new_tokens
        self.node = node_id()
        self.replica = uuid.uuid4().hex  # which replica answered: a pid can come back for another one
        self.counts = {
            "loads": 1,
            "caption_batches": 0,
            "captioned": 0,
            "structure_calls": 0,
            "structured": 0,
            "chat_calls": 0,
            "describe_calls": 0,
            "described": 0,
        }
        self.load_s = time.perf_counter() - started
        self.busy = 0
        self._structurer = None  # built on the first structuring request, on the same loaded model
        self._one = threading.Lock()

    async def _run(self, fn, *args):
        self.busy += 1
        try:
            return await asyncio.to_thread(self._locked, fn, *args)
        finally:
            self.busy -= 1

    def _locked(self, fn, *args):
        with self._one:
            return fn(*args)

    async def caption(self, batch: dict[str, np.ndarray], prompt: str) -> dict[str, list]:
        self.counts["caption_batches"] += 1
        self.counts["captioned"] += len(batch["video_id"])
        return await self._run(caption_batch, self.engine, self.node, batch, prompt, self.max_new_tokens)

    async def describe(self, requests: list) -> list:
        """Caption requests of any shape on the loaded engine (curation's one-frame descriptions), answered
        as the engine answers them."""
        self.counts["describe_calls"] += 1
        self.counts["described"] += len(requests)
        return await self._run(self.engine.generate, requests)

    async def structure(self, requests: list, batch_size: int) -> list:
        """Structuring requests (``core.structuring.policy``) on this replica's loaded model: the structurer
        'captioner' shares it instead of loading a second copy."""
        self.counts["structure_calls"] += 1
        self.counts["structured"] += len(requests)
        return await self._run(self._structure, requests, batch_size)

    def _structure(self, requests: list, batch_size: int) -> list:
        from video_assets.core.structuring.engines import TransformersStructurer

        if self._structurer is None:
            self._structurer = TransformersStructurer(loaded=self.engine.loaded)
        self._structurer.batch_size = max(1, int(batch_size))
        return self._structurer.generate(requests)

    async def chat(self, messages: list[dict], json_schema: dict | None, max_tokens: int) -> str:
        """A text-only chat turn on the loaded model (summaries, ask): greedy; with ``json_schema``, decoding
        constrained to it as structuring's is."""
        self.counts["chat_calls"] += 1
        return await self._run(self._chat, messages, json_schema, max_tokens)

    def _chat(self, messages: list[dict], json_schema: dict | None, max_tokens: int) -> str:
        from video_assets.core.inference import hf

        if json_schema is not None:
            from video_assets.core.structuring.policy import StructureRequest

            [reply] = self._structure([StructureRequest("chat", messages, json_schema, max_tokens)], 1)
            if reply.error:
                raise RuntimeError(reply.error)
            return reply.text
        loaded = self.engine.loaded
        text = loaded.chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        enc = loaded.tokenizer([text], return_tensors="pt", add_special_tokens=False).to(loaded.device)
        [ids] = hf.greedy(loaded, enc, max_tokens)
        return hf.completion(loaded, ids, max_tokens)[0]

    async def stats(self) -> dict:
        return {
            "replica": self.replica,
            "pid": os.getpid(),
            "node": self.node,
            "busy": self.busy,
            "load_s": self.load_s,
            **self.counts,
        }


def _serve_running() -> bool:
    """Whether Serve's controller runs on the connected Ray (asked without starting one)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def start_serve() -> None:
    """Serve on the connected Ray unless it runs there already (a user's cluster keeps its own proxy
    settings): handles only, no HTTP proxy, so nothing listens on a port."""
    from ray import serve

    if not _serve_running():
        serve.start(proxy_location="Disabled")


def app_status(name: str) -> str | None:
    """The Serve application's status (RUNNING, DEPLOYING, ...), or None when it is not deployed."""
    from ray import serve

    if not _serve_running():
        return None
    app = serve.status().applications.get(name)
    return None if app is None else str(getattr(app.status, "value", app.status))


def _application(spec: JobSpec):
    """``spec``'s caption application, bound and ready for ``serve.run`` or a Serve config's build: what
    ``deploy`` runs and what ``build`` gives ``serve deploy``, so the two cannot differ. Replicas: 0 to
    ``spec.vlm_concurrency``, scaled to zero after ``spec.warm_idle_s`` without requests."""
    from ray import serve

    idle = max(1.0, float(spec.warm_idle_s))
    gpu = spec.vlm_num_gpus > 0
    actor = {
        # A CPU replica reserves no logical CPU: idle, it uses none, and a step after captions (an archive
        # encoder) must not wait for it to scale to zero (measured before: about 300 s a batch on 2 CPUs).
        # The captions job leaves one CPU per replica free of decode tasks (``cpu_task_slots``).
        "num_cpus": 1 if gpu else 0,
        **({"num_gpus": spec.vlm_num_gpus} if gpu else {}),
        **({"resources": dict(spec.vlm_resources)} if spec.vlm_resources else {}),
    }
    return (
        serve.deployment(CaptionerReplica)
        .options(
            name=DEPLOYMENT,
            ray_actor_options=actor,
            max_ongoing_requests=IN_FLIGHT,
            autoscaling_config={
                "min_replicas": 0,
                "initial_replicas": 1,
                "max_replicas": max(1, spec.vlm_concurrency),
                "target_ongoing_requests": IN_FLIGHT,
                "upscale_delay_s": 0.0,
                "downscale_delay_s": idle,
                "downscale_to_zero_delay_s": idle,
                "look_back_period_s": min(idle, 30.0),
            },
            health_check_period_s=10.0,
            graceful_shutdown_timeout_s=5.0,
        )
        .bind(spec.engine, app_name(spec))
    )


def deploy(spec: JobSpec) -> str:
    """The name of ``spec``'s caption application, deployed unless it runs already (deployed by an earlier
    step, or by a Serve config from ``serve_config``: the name says what it computes, so a running
    application of that name is this model with these settings). The first replica loads the model before
    this returns. No handle here: requests go from Ray workers (``on_worker``, ``served_captions``)."""
    return run_once(app_name(spec), lambda: _application(spec), retire_idle)


def run_once(name: str, application, retire) -> str:
    """Serve application ``name`` (``application()``, bound) deployed unless it runs already, after
    ``retire(keep=name)`` deleted the idle applications it replaces; no HTTP route. Returns ``name``."""
    from ray import serve

    if app_status(name) in LIVE:
        return name
    start_serve()
    retire(keep=name)
    try:
        serve.run(application(), name=name, route_prefix=None)
        return name
    except Exception:
        if app_status(name) in LIVE:  # another step deployed it meanwhile
            return name
        raise


BUILDER = f"{__name__}:build"  # a Serve config's import_path


def spec_args(spec: JobSpec) -> dict:
    """What of ``spec`` its served application depends on, as plain data (a Serve config's ``args``)."""
    return {
        "engine": asdict(spec.engine),
        "num_gpus": spec.vlm_num_gpus,
        "resources": dict(spec.vlm_resources),
        "max_replicas": spec.vlm_concurrency,
        "idle_s": spec.warm_idle_s,
    }


def build(args: dict):
    """The application builder a Serve config names (``import_path: ...captioner:build``): ``spec_args``
    back into the bound application, so ``serve deploy`` (or a KubeRay RayService) runs exactly what the
    steps would deploy themselves."""
    engine = dict(args["engine"])
    engine["model"] = ModelFiles(**engine["model"])
    spec = JobSpec(
        sampling=SamplingConfig(),
        engine=EngineSpec(**engine),
        prompt="",
        vlm_concurrency=int(args.get("max_replicas", 1)),
        vlm_num_gpus=float(args.get("num_gpus", 0.0)),
        vlm_resources=dict(args.get("resources") or {}),
        warm_idle_s=float(args.get("idle_s", 300.0)),
    )
    return _application(spec)


def serve_config(spec: JobSpec) -> dict:
    """A Serve config file (``serve deploy`` / ``serve run`` / a RayService's ``serveConfigV2``) holding
    ``spec``'s caption application under the name the steps look for: a step that finds it running uses
    it as it is instead of deploying its own. No HTTP route (handles only)."""
    return config_file(app_name(spec), BUILDER, spec_args(spec))


def config_file(name: str, import_path: str, args: dict) -> dict:
    """A Serve config of one application built by ``import_path(args)``, HTTP proxy off (handles only)."""
    return {
        "proxy_location": "Disabled",
        "applications": [{"name": name, "route_prefix": None, "import_path": import_path, "args": args}],
    }


def retire_idle(keep: str) -> list[str]:
    """Delete the other caption applications that answer no request now (another model version, settings
    or code: a new application replaces them), so their idle replicas do not hold the CPUs, GPUs or the
    custom resources a pinned deployment needs until they scale to zero. A busy one is left to scale down
    by itself. Returns the applications deleted."""
    from ray import serve

    deleted = []
    for other in [n for n in serve.status().applications if n.startswith(APP_PREFIX) and n != keep]:
        try:
            if replicas(other) and stats(other, timeout_s=10)["busy"]:
                continue
            serve.delete(other, _blocking=True)
            deleted.append(other)
        except Exception:  # gone meanwhile, or not answering: Serve scales it down after its idle delay
            continue
    return deleted


def replicas(name: str) -> int:
    """How many replicas of application ``name`` run now (0 when scaled to zero or not deployed)."""
    from ray import serve

    if not _serve_running():
        return 0
    app = serve.status().applications.get(name)
    deployment = app.deployments.get(DEPLOYMENT) if app is not None else None
    return int(deployment.replica_states.get("RUNNING", 0)) if deployment is not None else 0


def _request(app: str, method: str, args: tuple, timeout_s: float | None = None):
    """``method(*args)`` on application ``app``, through a handle (sent again if the replica dies)."""
    from ray import serve

    handle = serve.get_app_handle(app)
    return _retried(lambda: getattr(handle, method).remote(*args).result(timeout_s=timeout_s))


def on_worker(app: str, method: str, *args, timeout_s: float | None = None):
    """``_request`` from a Ray task, not from this process: a handle's router (threads that push metrics to
    Serve's controller) lives in the process that sends, and a step's process leaves its Ray when the
    step ends, with the router still running (seen: errors after ``ray.shutdown``, a crash at exit)."""
    task = ray.remote(num_cpus=0, max_retries=0)(_request)
    return ray.get(task.remote(app, method, args, timeout_s))


def stats(name: str, timeout_s: float = 60.0) -> dict:
    """One replica's ``stats`` (the one Serve routes to: with one replica, the replica)."""
    return on_worker(name, "stats", timeout_s=timeout_s)


def _retried(call):
    """``call()`` (a request to the application), sent again when the replica died under it (Serve starts
    another), up to ``VLM_BATCH_RETRIES`` times; then its error."""
    for attempt in range(VLM_BATCH_RETRIES + 1):
        try:
            return call()
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if attempt == VLM_BATCH_RETRIES:
                raise
    raise AssertionError("unreachable")


_HANDLES: dict = {}  # a worker's handles by application: Ray reuses a job's workers for its tasks


def served_captions(
    batch: dict[str, np.ndarray], app: str, prompt: str, timeout_s: float | None = None
) -> dict[str, list]:
    """The captions job's model stage on a Serve application: a Ray Data task with no CPU of its own that
    sends a batch to the application and waits. A task, not an actor: it runs in the job's workers that
    decoded (each new process of a new job costs a start and imports). A replica that dies under a batch
    is replaced by Serve; the batch is sent again ``VLM_BATCH_RETRIES`` times, then fails and is dropped
    like any engine stage's (``tolerate_failed_batches``: its segments become error rows). A replica that
    does not answer within ``timeout_s`` (alive, but stalled) gets its request cancelled, and the batch's
    segments are error rows naming the timeout: the job goes on."""
    from ray import serve

    if (handle := _HANDLES.get(app)) is None:
        handle = _HANDLES[app] = serve.get_app_handle(app)

    def call():
        response = handle.caption.remote(batch, prompt)
        try:
            return response.result(timeout_s=timeout_s)
        except TimeoutError:
            response.cancel()
            return caption_batch(Unanswered(_timed_out(timeout_s)), None, batch, prompt, 0)

    return _retried(call)


def _timed_out(timeout_s: float | None) -> str:
    return f"timed out: the served engine gave no answer within {timeout_s:g} s (VLM_REQUEST_TIMEOUT_S)"


class Unanswered:
    """The engine interface answering every request with ``error`` (requests a server never answered)."""

    def __init__(self, error: str):
        self.error = error

    def generate(self, requests: list) -> list:
        from video_assets.core.captioning.requests import failed

        return [failed(r.request_id, self.error) for r in requests]


class ServedEngine:
    """The captioning engine interface (``generate``) on a caption application, for a Ray Data actor that
    holds no model (curation's frame descriptions): the replica that captions answers. A replica that dies
    under a call is replaced by Serve and the call sent again, as ``served_captions`` does."""

    def __init__(self, app: str):
        from ray import serve

        self.handle = serve.get_app_handle(app)

    def generate(self, requests: list) -> list:
        return _retried(lambda: self.handle.describe.remote(requests).result())


class ServedStructurer:
    """A structuring engine (``generate``) on the caption application of ``spec`` (deployed if it is not):
    the structurer 'captioner' on a Ray that outlives the steps."""

    name = "transformers (served caption engine)"
    speculative_retry = False  # a loaded model: a retry costs only its own (short) generation

    def __init__(self, spec: JobSpec, batch_size: int):
        self.batch_size = batch_size
        self.timeout_s = spec.request_timeout_s
        self.app = deploy(spec)

    def generate(self, requests: list) -> list:
        """The replica's answers; when it gives none within the request timeout (a stalled replica), each
        request's error says so (Ray raises the task's TimeoutError as one)."""
        from video_assets.core.structuring.policy import StructureResponse

        try:
            return on_worker(self.app, "structure", requests, self.batch_size, timeout_s=self.timeout_s)
        except TimeoutError:
            return [StructureResponse(q.request_id, "", error=_timed_out(self.timeout_s)) for q in requests]


CHAT_MAX_TOKENS = 512  # a chat turn's cap when the caller gives none (a summary of a video part)


class ServedChat:
    """The chat client of summaries (and ``LlmClient``'s interface: ``check``, ``model``, ``chat``) on the
    caption application of ``spec``, deployed if it is not: the caption model answers, loaded once for
    captions, structuring and summaries alike. Requests go from Ray workers (``on_worker``)."""

    def __init__(self, spec: JobSpec):
        self.app = deploy(spec)
        self.model = self.app  # what the summaries' ``summarizer`` names: this model, these settings, this code

    def __repr__(self) -> str:
        return f"ServedChat(app={self.app!r})"

    def check(self) -> str:
        return self.model

    def chat(self, messages: list[dict], json_schema: dict | None = None, max_tokens: int | None = None) -> str:
        return on_worker(self.app, "chat", messages, json_schema, int(max_tokens or CHAT_MAX_TOKENS))
