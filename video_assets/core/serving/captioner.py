"""The caption model as a Ray Serve application speaking the OpenAI chat-completions route: one loaded
engine that captions, structures and chats for every step on a Ray that outlives them (`video-assets ray up`,
or RAY_ADDRESS's cluster). Steps reach it as they reach any OpenAI-compatible endpoint (the endpoint
transport: ``core.inference.endpoint``), so a served model and a `vllm serve` are one code path.

    decode tasks (Ray Data) ─► EndpointRequests ─► Serve's HTTP proxy /<app>/v1/chat/completions ─► CaptionerReplica

The route takes the request every engine gets (``requests.video_chat_body``: one video part, its timing as
``video_metadata``), image parts, a ``response_format`` JSON schema (structuring) or text only (summaries,
ask). Serve owns the replicas: it starts one on the first request, batches concurrent requests
(``serve.batch``), starts another when requests queue (up to the job's ``vlm_concurrency``), replaces one that
dies, and stops the last after ``idle_s`` without requests (scale to zero). Each replica fetches and verifies
the registered model on its own node (``build_engine``: no shared filesystem). An application is named by
everything that decides what its engine computes (model files, device, limits, the code it runs), so a new
model version is a new application and the old one is retired.

Kept free of Dagster so it can be driven and tested with plain Ray.
"""

import asyncio
import functools
import hashlib
import hmac
import os
import threading
import time
import uuid
from dataclasses import asdict

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from video_assets.core.captioning.batch import EngineSpec, JobSpec, build_engine, node_id
from video_assets.core.captioning.requests import VideoChat
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.retries import VLM_BATCH_RETRIES
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.sources import module_digest

APP_PREFIX = "captioner-"
DEPLOYMENT = "Captioner"
# Batches of requests one replica holds at once: the next batch is there when one finishes (Serve queues the
# rest at the proxy and starts another replica when they pile up).
IN_FLIGHT = 2
CHAT_MAX_TOKENS = 512  # a chat turn's cap when the caller gives none (a summary of a video part)
BATCH_WAIT_S = 0.05  # how long a request waits for others to batch with (a job sends a batch's requests at once)
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


api = FastAPI(title="video-assets caption model", docs_url=None, redoc_url=None, openapi_url=None)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def _completion(model: str, text: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": int(prompt_tokens),
            "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens),
        },
    }


def _has_media(body: dict) -> bool:
    return any(
        isinstance(p, dict) and p.get("type") in ("video_url", "image_url")
        for m in body.get("messages") or []
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )


def _text_messages(body: dict) -> list[dict[str, str]]:
    """Chat messages with text content (parts joined), as the structurer and chat turns take them."""
    out = []
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        out.append({"role": str(m.get("role", "user")), "content": str(content or "")})
    return out


def structure_request(request_id: str, body: dict):
    """A chat request constrained to a JSON schema (``response_format``, as ``structuring.engines.structure_payload``
    sends it) as the structurer's ``StructureRequest``: the same messages, schema and token limit the in-job
    structurer is given. ValueError when the schema is missing."""
    from video_assets.core.structuring.policy import StructureRequest

    schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    limit = body.get("max_tokens") or body.get("max_completion_tokens") or CHAT_MAX_TOKENS
    return StructureRequest(request_id, _text_messages(body), schema, int(limit))


def key_sha256(key: str) -> str:
    """What a replica is given of the serve key: its digest (a Serve config holds no secret).
    Defined above the replica class: ``serve.ingress`` ships the class with the globals it sees then."""
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def bearer_ok(authorization: str, digest: str) -> bool:
    """Whether an ``Authorization`` header carries the bearer key ``digest`` is the digest of (``key_sha256``);
    with no digest, every request is. The one check of the served routes (this replica, ``vllm_server``)."""
    if not digest:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_sha256(token.strip()), digest)


@serve.ingress(api)
class CaptionerReplica:
    """One replica: the engine loaded once (its model fetched and verified on this node), then every caption,
    structuring and chat request of every step, through the OpenAI route. One generation at a time (a second
    would only share the same cores or GPU); requests that arrive together are batched; ``stats`` (a handle
    call, for operators and tests) answers while one runs. ``key_sha256``: requests must carry the bearer key
    it is the digest of (the instance's serve key: other local users' requests are refused); empty, none."""

    def __init__(self, engine: EngineSpec, app: str | None = None, key_sha256: str = ""):
        if app is not None:  # a config whose name and settings disagree would serve another model by that name
            running = serve.get_replica_context().app_name
            if running != app:
                raise RuntimeError(
                    f"this caption application is named {running!r}, but its settings make it {app!r}: steps "
                    "would take it for another model or code version. Write the Serve config again with "
                    "`video-assets ray serve-config` and deploy it unchanged"
                )
        started = time.perf_counter()
        self.engine = build_engine(engine)
        self.model = app or serve.get_replica_context().app_name  # what it answers as (not `app`: the ingress's)
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
        }
        self.load_s = time.perf_counter() - started
        self.busy = 0
        self._key = key_sha256
        self._structurer = None  # built on the first structuring request, on the same loaded model
        self._one = threading.Lock()
        self._captions.set_max_batch_size(max(1, engine.batch_size))
        self._structured.set_max_batch_size(max(1, engine.batch_size))

    async def _run(self, fn, *args):
        self.busy += 1
        try:
            return await asyncio.to_thread(self._locked, fn, *args)
        finally:
            self.busy -= 1

    def _locked(self, fn, *args):
        with self._one:
            return fn(*args)

    def _authorised(self, request: Request) -> bool:
        return bearer_ok(request.headers.get("authorization", ""), self._key)

    @api.get("/v1/models")
    async def models(self, request: Request):
        if not self._authorised(request):
            return _error(401, "a bearer key is required (the instance's serve key)")
        return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "video-assets"}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """A caption (a video, or images), a structuring request (``response_format`` with a JSON schema) or a
        chat turn (text only); greedy. A request the route cannot take is a 4xx naming why (not retried);
        an engine failure for one request is that request's 422, the others in its batch are answered."""
        if not self._authorised(request):
            return _error(401, "a bearer key is required (the instance's serve key)")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            return _error(400, f"not a JSON request: {exc}")
        if body.get("stream"):
            return _error(400, "stream is not supported")
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        fmt = body.get("response_format") or {}
        try:
            if _has_media(body):
                chat = VideoChat.from_openai(
                    uuid.uuid4().hex, body, min(int(limit or self.max_new_tokens), self.max_new_tokens)
                )
                answer = await self._captions(chat)
                if answer.error:
                    return _error(422, answer.error)
                return _completion(self.model, answer.text, answer.input_tokens, answer.output_tokens)
            if fmt.get("type") == "json_schema":
                reply = await self._structured(structure_request(uuid.uuid4().hex, body))
                if reply.error:
                    return _error(422, reply.error)
                return _completion(self.model, reply.text, 0, reply.output_tokens)
            self.counts["chat_calls"] += 1
            text = await self._run(self._chat, _text_messages(body), int(limit or CHAT_MAX_TOKENS))
            return _completion(self.model, text, 0, 0)
        except ValueError as exc:
            return _error(400, str(exc))

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=BATCH_WAIT_S)
    async def _captions(self, chats: list[VideoChat]) -> list:
        self.counts["caption_batches"] += 1
        self.counts["captioned"] += len(chats)
        return await self._run(self.engine.generate_chats, chats)

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=BATCH_WAIT_S)
    async def _structured(self, requests: list) -> list:
        """Structuring requests (``core.structuring.policy``) on this replica's loaded model: the structurer
        'captioner' shares it instead of loading a second copy."""
        self.counts["structure_calls"] += 1
        self.counts["structured"] += len(requests)
        return await self._run(self._structure, requests)

    def _structure(self, requests: list) -> list:
        from video_assets.core.structuring.engines import TransformersStructurer

        if self._structurer is None:
            self._structurer = TransformersStructurer(loaded=self.engine.loaded)
        self._structurer.batch_size = max(1, len(requests))
        return self._structurer.generate(requests)

    def _chat(self, messages: list[dict], max_tokens: int) -> str:
        """A text-only chat turn on the loaded model (summaries, ask): greedy."""
        from video_assets.core.inference import hf

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


DEFAULT_HTTP = {"host": "127.0.0.1", "port": 8100}  # unless VIDEO_SERVE_HOST / _PORT (resources.settings.serve_http)


def _proxy(http: dict | None) -> dict:
    """Serve's HTTP proxy options (host, port) from ``http`` (a spec's ``serve``), the defaults where unset."""
    http = {**DEFAULT_HTTP, **{k: v for k, v in (http or {}).items() if k in ("host", "port")}}
    return {"host": http["host"], "port": int(http["port"])}


def base_url(spec: JobSpec) -> str:
    """Where steps reach Serve's HTTP proxy (``spec.serve``'s url, else the default proxy's address)."""
    return str(spec.serve.get("url") or f"http://{DEFAULT_HTTP['host']}:{DEFAULT_HTTP['port']}").rstrip("/")


def start_serve(http: dict | None = None) -> None:
    """Serve on the connected Ray, its HTTP proxy on the head node only, at ``http``'s host and port (loopback
    by default). A Serve that runs already (the Ray service's, another step's, a user's cluster's) keeps its
    own proxy settings: Serve ignores new ones, with a warning (``deploy`` then checks the proxy answers)."""
    serve.start(proxy_location="HeadOnly", http_options=_proxy(http))


def app_status(name: str) -> str | None:
    """The Serve application's status (RUNNING, DEPLOYING, ...), or None when it is not deployed (or Serve is
    not running: its status is then empty, and nothing is started)."""
    app = serve.status().applications.get(name)
    return None if app is None else str(getattr(app.status, "value", app.status))


def _application(spec: JobSpec, key_digest: str | None = None):
    """``spec``'s caption application, bound and ready for ``serve.run`` or a Serve config's build: what
    ``deploy`` runs and what ``build`` gives ``serve deploy``, so the two cannot differ. Replicas: 0 to
    ``spec.vlm_concurrency``, scaled to zero after ``spec.warm_idle_s`` without requests. ``key_digest``: the
    serve key's (a config's args hold only that), else taken from ``spec.serve``."""

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
            # Requests are segments: a replica holds IN_FLIGHT batches of them (``serve.batch``).
            max_ongoing_requests=IN_FLIGHT * max(1, spec.engine.batch_size),
            autoscaling_config={
                "min_replicas": 0,
                "initial_replicas": 1,
                "max_replicas": max(1, spec.vlm_concurrency),
                "target_ongoing_requests": IN_FLIGHT * max(1, spec.engine.batch_size),
                "upscale_delay_s": 0.0,
                "downscale_delay_s": idle,
                "downscale_to_zero_delay_s": idle,
                "look_back_period_s": min(idle, 30.0),
            },
            health_check_period_s=10.0,
            graceful_shutdown_timeout_s=5.0,
        )
        .bind(
            spec.engine, app_name(spec), key_sha256(spec.serve.get("api_key", "")) if key_digest is None else key_digest
        )
    )


def served_endpoint(spec: JobSpec) -> dict:
    """``core.inference.endpoint.Endpoint`` fields of ``spec``'s caption application's OpenAI route: what the
    captions job, structuring, frame descriptions and chat send to, as to any endpoint that takes video."""
    name = app_name(spec)
    return {
        "url": f"{base_url(spec)}/{name}/v1",
        "model": name,
        "api_key": spec.serve.get("api_key", ""),
        "timeout_s": spec.request_timeout_s,
        "batch_size": spec.engine.batch_size,
        "concurrency": max(1, spec.vlm_concurrency) * IN_FLIGHT,
        "video": True,
    }


def deploy(spec: JobSpec) -> str:
    """The name of ``spec``'s caption application, deployed unless it runs already (deployed by an earlier
    step, or by a Serve config from ``serve_config``: the name says what it computes, so a running
    application of that name is this model with these settings). The first replica loads the model before
    this returns, and its route answers (``served_endpoint``), or a RuntimeError names the settings."""
    name = run_once(app_name(spec), lambda: _application(spec), retire_idle, http=spec.serve)
    check_route(spec, name)
    return name


def check_route(spec: JobSpec, name: str, timeout_s: float = 60.0) -> None:
    """Serve's HTTP proxy routes ``/<name>`` (``spec``'s application) at the URL steps send to, or a RuntimeError names the
    settings. Asked of the proxy's own route table (``/-/routes``: a replica busy with another step's batch,
    or scaled to zero, does not delay it). ``serve.run`` returns when the replica is up; the proxy learns
    routes from Serve's controller asynchronously, so this waits (bounded) until the route is listed."""
    import json
    import time
    import urllib.error
    import urllib.request

    base, prefix = base_url(spec), f"/{name}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{base}/-/routes", timeout=10) as answer:
                routes = json.loads(answer.read() or b"{}")
        except urllib.error.HTTPError:
            routes = {}  # the proxy answered, without a route table yet (503 until the controller sends one)
        except OSError as exc:
            raise RuntimeError(
                f"the served caption model {name} runs, but Serve's HTTP proxy does not answer at {base} "
                f"({exc.__class__.__name__}: {exc}): set VIDEO_SERVE_URL / VIDEO_SERVE_HOST / VIDEO_SERVE_PORT to "
                "where it listens (Serve keeps the proxy settings it was first started with), or restart the Ray service"
            ) from None
        if prefix in routes:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"Serve's HTTP proxy at {base} does not route {prefix} {timeout_s:.0f} s after the application started "
                f"(it routes {sorted(routes)}): is VIDEO_SERVE_URL another Serve's proxy?"
            )
        time.sleep(0.2)


def run_once(name: str, application, retire, http: dict | None = None) -> str:
    """Serve application ``name`` (``application()``, bound) deployed unless it runs already, after
    ``retire(keep=name)`` deleted the idle applications it replaces, at ``/<name>`` on Serve's HTTP proxy
    (``http``: where it listens, when this starts Serve). Returns ``name``."""
    if app_status(name) in LIVE:
        return name
    start_serve(http)
    retire(keep=name)
    try:
        serve.run(application(), name=name, route_prefix=f"/{name}")
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
        "key_sha256": key_sha256(spec.serve.get("api_key", "")),
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
    return _application(spec, key_digest=str(args.get("key_sha256") or ""))


def serve_config(spec: JobSpec) -> dict:
    """A Serve config file (``serve deploy`` / ``serve run`` / a RayService's ``serveConfigV2``) holding
    ``spec``'s caption application under the name the steps look for, at its route: a step that finds it
    running uses it as it is instead of deploying its own."""
    return config_file(app_name(spec), BUILDER, spec_args(spec), http=spec.serve)


def config_file(name: str, import_path: str, args: dict, http: dict | None = None) -> dict:
    """A Serve config of one application built by ``import_path(args)``, at ``/<name>`` on the HTTP proxy
    (``http``: its host and port)."""
    app = {"name": name, "route_prefix": f"/{name}", "import_path": import_path, "args": args}
    return {"proxy_location": "HeadOnly", "http_options": _proxy(http), "applications": [app]}


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


def deployment_name(app: str) -> str:
    """The deployment of application ``app`` whose replicas hold the engine (the same in every application)."""
    return DEPLOYMENT


def replicas(name: str) -> int:
    """How many replicas of application ``name`` run now (0 when scaled to zero or not deployed)."""
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
