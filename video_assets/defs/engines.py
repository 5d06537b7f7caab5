"""The model engines: which caption model the production alias names (resolved only here, by the captions
step and the promotion job), which engine runs it (``auto`` asked of the cluster), the GPUs it reserves, the
captions job's spec and the served applications that share one loaded model, and the structurer. Only the
stages that run a model import this (captions, structuring, curation, summaries, promotion)."""

from pathlib import Path

from dagster import Failure

from resources.mlflow_registry import MlflowRegistry
from resources.ray_service import ray_outlives_steps
from resources.settings import serve_http
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import VlmSettings, registered_endpoint
from video_assets.core import serving
from video_assets.core.captioning.batch import SERVED_ENGINES, EngineSpec, JobSpec, Transport
from video_assets.core.inference import choose_engine_name, vllm_importable, vllm_on_this_node
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.vllm import check_frames
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.qa.llm import LlmClient
from video_assets.defs.lineage import CaptionPair
from video_assets.defs.ray_session import cluster_gpus
from video_assets.defs.registry import CAPTION_PROMPT_NAME


def engine_name(vlm: VlmSettings) -> str:
    """``auto`` asks the cluster, not this process: a CPU-only orchestrator may drive GPU workers."""
    return choose_engine_name(vlm.engine, gpus=cluster_gpus(), has_vllm=cluster_has_vllm)


def cluster_has_vllm(timeout_s: float = 60.0) -> bool:
    """Whether vLLM imports on a GPU node of the connected Ray cluster, asked there (a task of no resources
    pinned to the node, in the job's runtime env): the Dagster machine's own packages say nothing about the
    workers'. False without a live GPU node or an answer in ``timeout_s``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and (n.get("Resources") or {}).get("GPU", 0) > 0]
    if not nodes:
        return False
    pinned = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
    probe = ray.remote(num_cpus=0, max_retries=0, scheduling_strategy=pinned)(vllm_on_this_node)
    try:
        return bool(ray.get(probe.remote(), timeout=timeout_s))
    except Exception:
        return False


def actor_gpus(vlm: VlmSettings, engine: str) -> float:
    """GPUs a transformers actor reserves, so Ray counts what it uses (vLLM places its own engines)."""
    if engine != "transformers":
        return 0.0
    if vlm.num_gpus is not None:
        return vlm.num_gpus
    return 1.0 if vlm.device != "cpu" and (cluster_gpus() or 0) > 0 else 0.0


def registered_model_files(registry: MlflowRegistry, vlm: VlmSettings, alias: str) -> tuple[ModelFiles, str]:
    """The version behind ``alias`` downloaded for this step, with what other nodes need to fetch it
    themselves; and the version."""
    return registry.model_files(vlm.registered_model, alias, Path(vlm.cache_dir) / "registry", vlm.cache_dir)


def resolve_caption_model(registry: MlflowRegistry, vlm: VlmSettings, alias: str | None = None):
    """(model files, caption pair, prompt) behind ``alias`` (the production alias by default): the one
    place the alias is resolved; a Failure that says what to run when nothing is registered."""
    alias = alias or vlm.alias
    try:
        model, model_version = registered_model_files(registry, vlm, alias)
        prompt = registry.load_prompt(CAPTION_PROMPT_NAME, alias)
    except Exception as exc:
        raise Failure(
            f"cannot resolve models:/{vlm.registered_model}@{alias} or prompts:/{CAPTION_PROMPT_NAME}@{alias} "
            f"in {registry.tracking_uri}: {exc}. Materialise vlm_model and caption_prompt first."
        ) from exc
    return model, CaptionPair(str(model_version), int(prompt.version)), prompt


def model_files_of(registry: MlflowRegistry, vlm: VlmSettings, version: str) -> ModelFiles:
    """The files of one caption model version (the one lineage names, whatever the alias says now),
    downloaded for this step, with what other nodes need to fetch them."""
    found = registry.client().get_model_version(vlm.registered_model, version)
    return registry.version_files(found, Path(vlm.cache_dir) / "registry", vlm.cache_dir)[0]


def job_spec(
    sampling: SamplingConfig,
    vlm: VlmSettings,
    engine: str,
    model: ModelFiles,
    prompt_template: str,
    cpu_to_accelerator: float | None = None,
) -> JobSpec:
    """The Ray job of a captioning run; a plan vLLM cannot honour, or an engine that cannot run the registered
    version (an endpoint's version on an in-job engine, or weights on the endpoint engine), is a Failure
    before anything starts."""
    try:
        vllm_settings = vlm.vllm_settings(model.path)
        if engine == "vllm":
            check_frames(vllm_settings, sampling.max_frames)
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    served = registered_endpoint(model.path)
    warm = vlm.warm_engine_idle_s if engine in SERVED_ENGINES and ray_outlives_steps() else 0.0
    if (engine == "endpoint") != (served is not None):
        raise Failure(
            f"the registered caption model ({model.artifact_uri or model.path}) is "
            + (f"the endpoint {served['url']} ({served['model']})" if served else "a folder of weights")
            + f", which the {engine} engine cannot run: set VLM_ENGINE to match it, or register the model this "
            "engine runs (materialise vlm_model with VLM_ENGINE=endpoint and VLM_ENDPOINT_URL, or without)",
            allow_retries=False,
        )
    return JobSpec(
        sampling=sampling,
        engine=EngineSpec(
            engine,
            model,
            vlm.device,
            vlm.batch_size,
            vlm.max_new_tokens,
        ),
        prompt=prompt_template,
        cpu_concurrency=vlm.cpu_concurrency,
        vlm_concurrency=vlm.concurrency,
        vlm_num_gpus=actor_gpus(vlm, engine),
        cpu_resources=dict(vlm.decode_resources),
        vlm_resources=dict(vlm.model_resources),
        vllm=vllm_settings.model_dump(),
        warm_idle_s=warm,
        endpoint=vlm.endpoint(served) if served else {},
        serve=serve_http() if warm > 0 else {},
        request_timeout_s=vlm.endpoint_timeout_s,
        cpu_to_accelerator=cpu_to_accelerator,
    )


def captions_job_spec(
    vlm: VlmSettings, model: ModelFiles, prompt_template: str, sampling: SamplingConfig, calibration
) -> JobSpec:
    """The captions step's job: the engine chosen once (``engine_name``: ``auto`` asked of the cluster), how it is
    reached read from the spec (``JobSpec.transport``). vLLM's decode stage is sized by ``calibration(engine)``
    (the throughput model's ratio measured on earlier batches), asked only for vLLM."""
    engine = engine_name(vlm)
    ratio = calibration(engine) if engine == "vllm" else None
    return job_spec(sampling, vlm, engine, model, prompt_template, cpu_to_accelerator=ratio)


def preflight(spec: JobSpec) -> None:
    """An endpoint that does not answer is a Failure naming the setting before Ray starts, not a batch of error
    rows. The product's own served model is checked when it is deployed (``core.serving.deploy``)."""
    if spec.transport is Transport.ENDPOINT and not spec.served:
        from video_assets.core.inference.endpoint import Endpoint, EndpointUnavailable

        try:
            Endpoint(**spec.endpoint).check()
        except EndpointUnavailable as exc:
            raise Failure(str(exc)) from None


def served_caption_spec(vlm: VlmSettings, model: ModelFiles) -> JobSpec | None:
    """The spec of the caption model's served application on the Ray that outlives the steps (the captions
    engine's: vLLM when it resolves to vLLM, else transformers), what another step needs to use the same loaded
    replica; None without such a Ray (then engines load in the job). Ray must be connected."""
    engine = engine_name(vlm)
    spec = job_spec(SamplingConfig(), vlm, engine if engine in SERVED_ENGINES else "transformers", model, "")
    return spec if spec.served else None


def served_application(vlm: VlmSettings, model: ModelFiles) -> dict | None:
    """The endpoint fields of ``served_caption_spec``'s OpenAI route, its application deployed if it is not;
    None without a Ray that outlives the steps."""
    spec = served_caption_spec(vlm, model)
    if spec is None:
        return None
    serving.deploy(spec)
    return serving.endpoint(spec)


def describer(vlm: VlmSettings, model: ModelFiles) -> tuple[EngineSpec, dict | None, str]:
    """Curation's frame describer on caption model version ``model`` (the one that captioned): the engine, the
    route it is reached on (``Endpoint`` fields) and what it is, for the metadata: the version's own endpoint
    when it is one (with the captions' request bounds); the served application's route on a Ray that outlives
    the steps (loaded once for captions, structuring, summaries and these); else no route, an engine loaded
    in the job."""
    if registered := registered_endpoint(model.path):
        endpoint = vlm.endpoint(registered)
        engine = EngineSpec("endpoint", model, vlm.device, vlm.batch_size, vlm.max_new_tokens)
        return engine, endpoint, f"endpoint {endpoint['url']} ({endpoint['model']})"
    engine = EngineSpec("transformers", model, vlm.device, vlm.batch_size, vlm.max_new_tokens)
    if (route := served_application(vlm, model)) is not None:
        return engine, route, f"served application {route['model']}"
    return engine, None, "in-job transformers"


def structuring_engine(
    settings: StructurerSettings, vlm: VlmSettings, registry: MlflowRegistry, model_version: str, connect_ray
):
    """The structurer of a step (``make_structurer``): with the captioning model (``STRUCTURER_MODEL=captioner``),
    the version that captioned, reached as its captions were: its endpoint when it is one, its served application
    on a Ray that outlives the steps (``connect_ray()`` joins it), else loaded here or in the job."""
    files = model_files_of(registry, vlm, model_version) if settings.model == CAPTIONER else None
    registered = registered_endpoint(files.path) if files is not None else None
    warm = None
    if files is not None and registered is None and ray_outlives_steps():
        connect_ray()
        warm = served_caption_spec(vlm, files)
    return make_structurer(
        settings, files, connect_ray=connect_ray, warm=warm, endpoint=vlm.endpoint(registered) if registered else None
    )


def caption_model_chat(
    vlm: VlmSettings, registry: MlflowRegistry, model_version: str, connect_ray, timeout_s: float = 30.0
):
    """A chat client (``LlmClient``'s interface) on caption model ``model_version`` (``LLM_BASE_URL=captioner``):
    its endpoint when the version is one, else its Ray Serve application, shared with captions and
    structuring. ``connect_ray()`` joins the Ray that outlives the steps; a Failure naming the settings
    when there is none (a model loaded in the step for a few summaries would cost more than it saves)."""
    files = model_files_of(registry, vlm, model_version)
    if (served := registered_endpoint(files.path)) is not None:
        endpoint = vlm.endpoint(served)
        return LlmClient(endpoint["url"], endpoint["model"], endpoint["api_key"], timeout_s)
    if not ray_outlives_steps():
        raise Failure(
            "LLM_BASE_URL=captioner asks the caption model's served application, which needs a Ray that outlives "
            "the steps: run `video-assets ray up` (or `make ui`), or set RAY_ADDRESS; or set LLM_BASE_URL to an "
            "OpenAI-compatible endpoint, or unset it (extractive summaries)",
            allow_retries=False,
        )
    connect_ray()
    route = served_application(vlm, files)
    if route is None:  # unreachable while ray_outlives_steps() holds
        raise Failure("the caption model is not served on this Ray", allow_retries=False)
    return LlmClient(route["url"], route["model"], route["api_key"], max(timeout_s, route["timeout_s"] or 0.0))


def make_structurer(
    settings: StructurerSettings,
    captioner: ModelFiles | Path | str | None,
    connect_ray=None,
    warm: JobSpec | None = None,
    endpoint: dict | None = None,
):
    """The engine for ``settings`` (the captioning model's files when model is 'captioner').

    ``connect_ray()`` connects to Ray through the step's Ray resource and returns the cluster's GPU
    count; it is called only when vLLM could run (asked for, or ``auto`` with vLLM installed here or a Ray
    that outlives the steps to ask), so the CPU default never starts Ray for structuring. Without it, the
    GPUs this process sees decide.
    ``warm``: the captions step's served application (``served_caption_spec``: the step joined a Ray that
    outlives it); the 'captioner' structurer on that engine asks its route, on the loaded replica, instead of
    loading the model again here. ``endpoint``: the captioning model is an endpoint
    (``VlmSettings.endpoint``); the 'captioner' structurer then asks it, whatever ``engine`` says."""
    if settings.model == CAPTIONER and endpoint is not None:
        from video_assets.core.structuring.engines import EndpointStructurer

        if connect_ray is not None:
            connect_ray()  # the requests go through a Ray Data job
        return EndpointStructurer(endpoint)
    if (settings.engine or "").strip().lower() == "endpoint":
        raise ValueError(
            "STRUCTURER_ENGINE=endpoint structures with the captioning endpoint: set STRUCTURER_MODEL=captioner "
            "and register the captioning model with VLM_ENGINE=endpoint"
        )
    files = captioner if isinstance(captioner, ModelFiles) or captioner is None else ModelFiles(str(captioner))
    if settings.model == CAPTIONER and files is None:
        raise ValueError("structuring with the captioning model needs its files")
    model = files.path if settings.model == CAPTIONER else settings.model
    requested = (settings.engine or "auto").strip().lower()
    gpus = None
    # auto asks the cluster when vLLM could run there: this process has it, or steps join a Ray that outlives
    # them (RAY_ADDRESS, `ray up`), whose GPU workers may have it whatever this (CPU-only) process has.
    if requested == "vllm" or (requested == "auto" and (vllm_importable() or ray_outlives_steps())):
        gpus = connect_ray() if connect_ray is not None else cluster_gpus()
    chosen = choose_engine_name(settings.engine, gpus=gpus, has_vllm=cluster_has_vllm)
    if warm is not None and settings.model == CAPTIONER and warm.engine.name == chosen:
        from video_assets.core.structuring.engines import EndpointStructurer

        if connect_ray is not None:
            connect_ray()  # the deploy, and the requests: a Ray Data job
        serving.deploy(warm)  # the captions step's application, on its route (deployed again if it was retired)
        return EndpointStructurer(serving.endpoint(warm), name=f"{chosen} (served caption model)")
    if chosen == "vllm":
        from video_assets.core.structuring.engines import VllmStructurer

        return VllmStructurer(settings.vllm_settings(model), files if settings.model == CAPTIONER else None)
    from video_assets.core.structuring.engines import TransformersStructurer

    # Loaded in this process: the registered model's weights fetched here (the step resolved its small files).
    local = files.here() if settings.model == CAPTIONER else model
    return TransformersStructurer(local, settings.device, settings.batch_size)
