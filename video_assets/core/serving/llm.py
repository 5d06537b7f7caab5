"""The vLLM caption model as a ``ray.serve.llm`` application: one engine that captions and structures for
every step on a Ray that outlives them (`video-assets ray up`, or RAY_ADDRESS's cluster).

    decode tasks (Ray Data) ─► ServeDeploymentStage (Ray Data LLM, 0-CPU callers) ─► handle ─► LLMServer (vLLM)

Ray Serve LLM owns the engine (``LLMServer``: vLLM's async engine, its health checks, restarts and
autoscaling, down to zero after ``warm_idle_s`` without requests); the steps send OpenAI chat requests
through a deployment handle (no HTTP proxy, no port). A caption request carries the same messages and
video metadata as the in-job vLLM engine's (``vllm_engine.to_vllm_row``), so both give the model the same
input; structuring sends the use case's JSON schema as ``response_format`` and reads the same OpenAI
answer an endpoint gives (``inference.endpoint.read_answer``).

The application is named by what decides what its engine computes (model files, engine settings, this
code's version): a new model version is a new application, and the old one scales to zero by itself.
With ``warm_idle_s`` 0 (batch mode) or the model folder not on every node, engines run inside each job
as before (``vllm_engine.build_vllm_processor_for_job``).

Kept free of Dagster, as ``captioner`` is.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
from dataclasses import asdict
from typing import Any

from video_assets.core.captioning.batch import EngineSpec, JobSpec
from video_assets.core.captioning.rows import result_row
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import (
    ERROR_KEY,
    VllmSettings,
    bounded_engine_retries,
    engine_env,
    engine_kwargs,
)
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.serving.captioner import app_status, code_version, config_file, run_once
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK

APP_PREFIX = "vllm-"
STAGE = "ServeDeploymentStage"  # Ray Data LLM's stage that calls the deployment
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
    """The LLMServer deployment ``build_llm_deployment`` names after the model id (the application's name)."""
    return f"LLMServer:{app}"


def served(spec: JobSpec) -> bool:
    """Whether ``spec``'s vLLM engine is a served application: a Ray that outlives the steps
    (``warm_idle_s`` > 0) and the model folder on every node (a Serve replica opens it by path wherever
    Serve starts it; without a shared folder the in-job stages fetch it on their nodes instead)."""
    if spec.engine.name != "vllm" or spec.warm_idle_s <= 0:
        return False
    from video_assets.core.inference.model_cache import place_on_every_node

    return not place_on_every_node(spec.engine.model).per_node


def llm_config(spec: JobSpec, name: str):
    """The ``ray.serve.llm.LLMConfig`` of ``spec``'s engine: the job's vLLM settings (engine arguments,
    placement, accelerator type, workers' environment), 0 to ``concurrency`` replicas."""
    from ray.serve.llm import LLMConfig

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
    )


def deploy(spec: JobSpec) -> str:
    """The name of ``spec``'s vLLM application, deployed unless it runs already (an earlier step's: the
    name says what it computes). The first replica has loaded the model when this returns."""
    from ray.serve.llm import build_llm_deployment

    name = app_name(spec)
    return run_once(
        name, lambda: build_llm_deployment(llm_config(spec, name)), retire_idle, http=spec.serve, route=False
    )


BUILDER = f"{__name__}:build"  # a Serve config's import_path


def spec_args(spec: JobSpec) -> dict:
    """What of ``spec`` its application depends on, as plain data (a Serve config's ``args``), with the name
    it computes: ``build`` refuses args edited under that name."""
    return {
        "name": app_name(spec),
        "model": asdict(spec.engine.model),
        "vllm": dict(spec.vllm),
        "idle_s": spec.warm_idle_s,
    }


def build(args: dict):
    """The application builder a Serve config names (``import_path: ...llm:build``): ``spec_args`` back into
    the application the steps deploy themselves, so ``serve deploy`` (or a KubeRay RayService) runs exactly
    it and the steps find it by name."""
    from ray.serve.llm import build_llm_deployment

    spec = spec_from_args(args)
    return build_llm_deployment(llm_config(spec, app_name(spec)))


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
    application under the name the steps look for: a step that finds it running uses it as it is."""
    return config_file(app_name(spec), BUILDER, spec_args(spec))


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


def build_processor(app: str, batch_size: int, actors: int, preprocess, postprocess, timeout_s: float | None):
    """Ray Data LLM's Serve deployment processor on ``app``'s chat method: ``actors`` callers without a CPU
    (the replica holds the engine and its CPUs or GPUs), each sending a batch's ``batch_size`` requests at once;
    a failed request, or one not answered within ``timeout_s`` (a stalled replica), is an error row, a batch
    whose caller dies is tried as every engine stage's is."""
    from ray.data.llm import ServeDeploymentProcessorConfig
    from ray.data.llm import build_processor as build
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    config = ServeDeploymentProcessorConfig(
        deployment_name=deployment_name(app),
        app_name=app,
        dtype_mapping={"ChatCompletionRequest": ChatCompletionRequest},
        batch_size=batch_size,
        concurrency=max(1, actors),
        should_continue_on_error=True,
        request_timeout_s=timeout_s,
    )
    processor = build(config, preprocess=preprocess, postprocess=postprocess)
    stage = processor.get_stage_by_name(STAGE)
    stage.fn = _json_request_udf()
    stage.map_batches_kwargs["num_cpus"] = 0
    return bounded_engine_retries(processor, STAGE)


def _json_request_udf():
    """Ray's Serve stage taking the request as JSON text (defined lazily: Ray's LLM package is imported only
    where a served engine is used)."""
    from ray.llm._internal.batch.stages.serve_deployment_stage import ServeDeploymentStageUDF

    class JsonRequestUDF(ServeDeploymentStageUDF):
        def _prepare_request(self, row):
            return super()._prepare_request({**row, "request_kwargs": json.loads(row["request_kwargs"])})

    return JsonRequestUDF


def chat_row(app: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A chat completion request as the Serve stage's row. The request travels as JSON text: its nested
    messages, video metadata and schemas differ between rows, which Ray's blocks would otherwise unify
    (turning lists into arrays and filling absent keys with nulls the request model refuses)."""
    return {"method": "chat", "dtype": "ChatCompletionRequest", "request_kwargs": json.dumps({**payload, "model": app})}


def answer_row(row: dict[str, Any]) -> dict[str, Any]:
    """The Serve stage's output row (an OpenAI chat completion spread into the row, or an error answer) as
    ``inference.endpoint.read_answer`` reads an endpoint's."""
    response = {k: row.get(k) for k in ("choices", "usage", "error") if row.get(k) is not None}
    return {"http_response": response, "endpoint_s": row.get("time_taken"), ERROR_KEY: row.get(ERROR_KEY) or ""}


def caption_result(row: dict[str, Any]) -> dict[str, Any]:
    """A segment row as the job's RESULT_COLUMNS, from an answer or an error row (decode or request)."""
    from video_assets.core.inference.endpoint import read_answer

    if row.get("status") in (CAPTION_OK, CAPTION_ERROR):  # already shaped by the postprocess
        return row
    answer = read_answer(answer_row(row) if "http_response" not in row else row)
    error = answer.caption_error("the served engine")
    return result_row(row, answer.text, answer.input_tokens, answer.output_tokens, answer.latency_s, error)


def caption_request_row(row: dict[str, Any], spec: JobSpec, app: str) -> dict[str, Any]:
    """A decoded segment row's chat request to ``app``: the in-job vLLM engine's messages (the frames as a
    video part) and video metadata (the frames' real times), greedy, at most the job's max_new_tokens. The
    CPU stage's error row, or frames that cannot be sent, become Ray's error row, which the Serve stage skips."""
    from video_assets.core.captioning.vllm_engine import segment_vllm_row

    vllm_row = segment_vllm_row(row, spec.prompt, VllmSettings(**spec.vllm))
    if vllm_row[ERROR_KEY]:
        return {**chat_row(app, {}), ERROR_KEY: vllm_row[ERROR_KEY]}
    return {**chat_row(app, chat_payload(vllm_row)), ERROR_KEY: ""}


def chat_payload(vllm_row: dict[str, Any]) -> dict[str, Any]:
    """A caption request's vLLM row (``vllm_engine.to_vllm_row``) as the chat completion the application
    takes: the same messages, sampling and video metadata."""
    return {
        "messages": vllm_row["messages"],
        "max_tokens": int(vllm_row["sampling_params"]["max_tokens"]),
        "temperature": 0.0,
        "mm_processor_kwargs": vllm_row["mm_processor_kwargs"],
    }


def callers(settings: VllmSettings) -> int:
    """Ray Data actors that send a job's requests: each sends a batch's rows at once, so enough batches in
    flight to fill every replica's ``max_num_seqs``, twice over so the next is there when one finishes."""
    return 2 * settings.concurrency * max(1, math.ceil(settings.max_num_seqs / settings.batch_size))


def build_served_processor_for_job(ds, spec: JobSpec, app: str):
    """The captions job's model stage on application ``app`` (``caption_request_row`` per segment)."""
    settings = VllmSettings(**spec.vllm)
    processor = build_processor(
        app,
        settings.batch_size,
        callers(settings),
        preprocess=functools.partial(caption_request_row, spec=spec, app=app),
        postprocess=caption_result,
        timeout_s=spec.request_timeout_s,
    )
    # Ray's error rows bypass the postprocess; shape them too.
    return processor(ds).map(caption_result)


class ServedLlmStructurer:
    """A structuring engine (``generate``) on the vLLM caption application of ``spec`` (deployed if it is
    not): one chat request per caption with the use case's JSON schema as ``response_format``. The engine is
    loaded already, so a retry costs only its own request: the retry pass goes only for the rows whose
    first pass failed."""

    speculative_retry = False

    def __init__(self, spec: JobSpec, batch_size: int):
        self.app = deploy(spec)
        self.batch_size = batch_size
        self.timeout_s = spec.request_timeout_s
        self.name = f"vllm (served application {self.app})"

    def generate(self, requests: list) -> list:
        from video_assets.core.inference.service_runner import on_cluster
        from video_assets.core.structuring.engines import REQUEST_KEY, answered, structure_payload

        if not requests:
            return []
        items = [{REQUEST_KEY: q.request_id, **chat_row(self.app, structure_payload(self.app, q))} for q in requests]
        rows = on_cluster(_structure_rows, self.app, self.batch_size, items, self.timeout_s)
        return answered(requests, rows, "no answer from the served engine after every try (see the Ray logs)")


def _structure_rows(app: str, batch_size: int, items: list[dict], timeout_s: float | None):
    """The requests' answer rows as an endpoint's (``answer_row``), each with its request id."""
    import ray

    from video_assets.core.inference.retries import tolerate_failed_batches
    from video_assets.core.structuring.engines import REQUEST_KEY

    def _post(row: dict[str, Any]) -> dict[str, Any]:
        if "http_response" in row:  # Ray's error rows bypass the postprocess: this runs again after it
            return row
        return {REQUEST_KEY: row[REQUEST_KEY], **answer_row(row)}

    processor = build_processor(
        app, batch_size, batch_size, preprocess=lambda row: row, postprocess=_post, timeout_s=timeout_s
    )
    yield from tolerate_failed_batches(processor(ray.data.from_items(items)).map(_post)).take_all()


CHAT_MAX_TOKENS = 512  # a chat turn's cap when the caller gives none (as the transformers application's)


def _handle(app: str):
    from ray import serve

    return serve.get_deployment_handle(deployment_name(app), app).options(stream=True)


async def _answer(handle, app: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One chat completion from the LLMServer behind ``handle`` (its ``chat`` streams: the first item is
    the whole answer of a non-streaming request), as a plain dict."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest

    async for item in handle.chat.remote(ChatCompletionRequest(**{**payload, "model": app})):
        return item.model_dump() if hasattr(item, "model_dump") else item
    return {}


def _chat_once(app: str, payload: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    answer = _answer(_handle(app), app, payload)
    return asyncio.run(asyncio.wait_for(answer, timeout_s) if timeout_s else answer)


class ServedLlmEngine:
    """The captioning engine interface (``generate``) on a vLLM application, for a Ray Data actor that holds
    no model (curation's frame descriptions): a call's requests go at once, each a chat turn with the in-job
    engine's messages and video metadata; a request that fails is its response's error."""

    def __init__(self, app: str):
        self.app = app
        self.handle = _handle(app)

    def generate(self, requests: list) -> list:
        from video_assets.core.captioning.requests import CaptionResponse
        from video_assets.core.captioning.vllm_engine import to_vllm_row
        from video_assets.core.inference.endpoint import read_answer

        async def one(req):
            row = to_vllm_row(req)
            if row[ERROR_KEY]:
                return CaptionResponse(req.request_id, "", error=row[ERROR_KEY])
            try:
                answer = read_answer(answer_row(await _answer(self.handle, self.app, chat_payload(row))))
            except Exception as exc:  # a replica that died, a refused request: this frame's error
                return CaptionResponse(req.request_id, "", error=f"{exc.__class__.__name__}: {exc}")
            return CaptionResponse(
                req.request_id, answer.text, answer.input_tokens, answer.output_tokens, 0.0, error=answer.error
            )

        async def every():
            return await asyncio.gather(*(one(r) for r in requests))

        return list(asyncio.run(every()))


class ServedLlmChat:
    """The chat client of summaries and the ask box (``LlmClient``'s interface: ``check``, ``model``,
    ``chat``) on the vLLM caption application of ``spec``, deployed if it is not: the caption model answers,
    loaded once for captions, structuring and chat. Requests go from a Ray task (a handle's router lives in
    the process that sends, as ``captioner.on_worker`` explains)."""

    def __init__(self, spec: JobSpec, timeout_s: float = 120.0):
        self.app = deploy(spec)
        self.model = self.app  # what the summaries' ``summarizer`` names: this model, these settings, this code
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"ServedLlmChat(app={self.app!r})"

    def check(self) -> str:
        return self.model

    def chat(self, messages: list[dict], json_schema: dict | None = None, max_tokens: int | None = None) -> str:
        import ray

        from video_assets.core.inference.endpoint import read_answer

        payload: dict[str, Any] = {
            "messages": messages,
            "max_tokens": int(max_tokens or CHAT_MAX_TOKENS),
            "temperature": 0.0,
        }
        if json_schema is not None:
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": json_schema},
            }
        task = ray.remote(num_cpus=0, max_retries=0)(_chat_once)
        answer = read_answer(answer_row(ray.get(task.remote(self.app, payload, self.timeout_s))))
        if answer.error:
            from video_assets.core.qa.llm import LlmUnavailable

            raise LlmUnavailable(f"the served caption model {self.app} answered with an error: {answer.error}")
        return answer.text


def engine_service(spec: JobSpec, served_app: str | None = None) -> dict:
    """Where a captions job's engine ran, for its materialisation: an endpoint, the served application (the
    vLLM one the job's rows name, ``served_app``; the transformers one in ``captioner``) and its replicas
    now, or the job's own engines."""
    from video_assets.core.serving import captioner

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
    if spec.engine.name == "transformers" and spec.warm_idle_s > 0:  # the caption application, on its route
        name = served_app or captioner.app_name(spec)
        deployment = captioner.DEPLOYMENT
        return {"mode": "served", "application": name, "deployment": deployment, "replicas": captioner.replicas(name)}
    if served_app:  # the vLLM application the job's rows name
        return {
            "mode": "served",
            "application": served_app,
            "deployment": deployment_name(served_app),
            "replicas": replicas(served_app),
        }
    return {"mode": "in-job", "engine": spec.engine.name, "actors": spec.vlm_concurrency}
