"""The model engines, in one place for every stage that runs one (captions, structuring, curation,
promotion, the archive stages): which caption model the production alias names (resolved only here,
by the captions step and the promotion job), which engine runs it, the GPUs it reserves, the Ray job
of a captioning run and the streaming write of its rows, and the structurer."""

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
from dagster import Failure, MetadataValue

from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry
from resources.ray_service import ray_outlives_steps
from resources.structurer import CAPTIONER, StructurerSettings
from resources.vlm import VlmSettings, registered_endpoint
from video_assets.core.captioning.job import EngineSpec, JobSpec, caption_rows
from video_assets.core.captioning.versions import caption_digest, split_key
from video_assets.core.inference import choose_engine_name, vllm_importable, vllm_on_this_node
from video_assets.core.inference.model_cache import ModelFiles
from video_assets.core.inference.retries import NO_RESULT
from video_assets.core.inference.service_runner import on_cluster
from video_assets.core.inference.vllm import check_frames
from video_assets.core.media.sampling import SamplingConfig
from video_assets.core.qa.llm import LlmClient
from video_assets.core.serving.captioner import ServedChat, deploy
from video_assets.core.serving.llm import engine_service
from video_assets.core.structuring import usecase as uc_mod
from video_assets.core.structuring.policy import structure_captions
from video_assets.core.structuring.versions import StructuringPlan
from video_assets.core.tables import CAPTIONS, KEYS, SAMPLED_FRAMES, SCHEMAS, to_arrow
from video_assets.core.throughput import covered_seconds
from video_assets.core.uploads.discovery import printable
from video_assets.core.vocabulary import CAPTION_ERROR, CAPTION_OK
from video_assets.defs.lineage import CaptionPair
from video_assets.defs.registry import CAPTION_PROMPT_NAME

PREVIEW_VIDEOS = 3  # videos whose sampled frames the materialisation shows
WRITE_EVERY = 32  # rows per Delta merge (whole videos): a crash loses at most this much work


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


def calibration_runs(
    instance, engine: str | None = None, limit: int = 20, runs: int = 2
) -> list[tuple[dict, float, int]]:
    """The latest captions materialisations that captioned something (of ``engine`` when given), of different
    sizes (up to ``runs``): each one's cost breakdown, video seconds and requests (what the throughput
    model calibrates on: `video-assets predict`, and vLLM's decode width)."""
    from dagster import AssetKey

    found: list[tuple[dict, float, int]] = []
    for record in instance.fetch_materializations(AssetKey("captions"), limit=limit, ascending=False).records:
        meta = record.asset_materialization.metadata
        if engine is not None and (meta.get("engine") is None or meta["engine"].value != engine):
            continue
        if "cost_breakdown" in meta and meta.get("requests") and meta["requests"].value > 0:
            requests = int(meta["requests"].value)
            if requests not in {r for _, _, r in found}:
                found.append((meta["cost_breakdown"].value, float(meta["video_s"].value), requests))
            if len(found) == runs:
                break
    return found


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
        warm_idle_s=vlm.warm_engine_idle_s if engine in ("transformers", "vllm") and ray_outlives_steps() else 0.0,
        endpoint=vlm.endpoint(served) if served else {},
        request_timeout_s=vlm.endpoint_timeout_s,
        cpu_to_accelerator=cpu_to_accelerator,
    )


def warm_engine_spec(vlm: VlmSettings, model: ModelFiles) -> JobSpec | None:
    """The spec that names the captions step's served transformers engine for ``model`` (what another
    step needs to use the same loaded replica), or None when engines are not served (no Ray that
    outlives the steps)."""
    spec = job_spec(SamplingConfig(), vlm, "transformers", model, "")
    return spec if spec.warm_idle_s > 0 else None


def served_vllm_spec(vlm: VlmSettings, model: ModelFiles) -> JobSpec | None:
    """The spec that names the captions step's served vLLM application for ``model`` (structuring on the
    same engine), or None when vLLM engines are not served (no Ray that outlives the steps, or batch mode)."""
    spec = job_spec(SamplingConfig(), vlm, "vllm", model, "")
    return spec if spec.warm_idle_s > 0 else None


def served_caption_spec(vlm: VlmSettings, model: ModelFiles) -> JobSpec | None:
    """The spec of the caption model's Serve application on the Ray that outlives the steps: the vLLM one
    (``ray.serve.llm``) when the captions engine is vLLM and it can be served, else the transformers one;
    None without such a Ray (then engines load in the job). Ray must be connected."""
    if engine_name(vlm) == "vllm" and (vllm_spec := served_vllm_spec(vlm, model)) is not None:
        from video_assets.core.serving import llm

        if llm.served(vllm_spec):
            return vllm_spec
    return warm_engine_spec(vlm, model)


def served_application(vlm: VlmSettings, model: ModelFiles) -> str | None:
    """``served_caption_spec``'s application, deployed if it is not; None without a Ray that outlives the steps."""
    from video_assets.core.serving import llm

    spec = served_caption_spec(vlm, model)
    if spec is None:
        return None
    return llm.deploy(spec) if spec.engine.name == "vllm" else deploy(spec)


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
    spec = served_caption_spec(vlm, files)
    if spec is None:  # unreachable while ray_outlives_steps() holds
        raise Failure("the caption model is not served on this Ray", allow_retries=False)
    if spec.engine.name == "vllm":  # the captions step's vLLM application
        from video_assets.core.serving import llm

        return llm.ServedLlmChat(spec, timeout_s)
    return ServedChat(spec)


def run_captioning(
    log,
    tables: DeltaTables,
    todo: pl.DataFrame,
    spec: JobSpec,
    stamp: dict,
    pending: list[dict] | None = None,
    table: str = CAPTIONS,
) -> dict:
    """Caption ``todo`` (video_metadata rows) with one Ray Data job. Rows are written whole videos at a
    time (merged every WRITE_EVERY rows), each write replacing everything the video had for this model
    and prompt, so a crash between writes never leaves a video half captioned, and stale segments of an
    earlier split go. ``pending`` rows (e.g. probe rejects) are written with the first merge."""
    started = time.perf_counter()
    split = split_key(spec.sampling)
    ready = [{**r, "segments": 1} for r in pending or []]
    arrived: dict[str, dict[int, dict]] = {}  # video -> segment -> row, until every planned segment is in
    whole: set[str] = set()  # videos every planned segment of which came back
    written = cpu_s = engine_s = delta_s = 0.0
    frame_bytes = 0  # the JPEGs the decode stage sent (what crossed the object store)
    screened: list[dict] = []  # frames screened before the engine (media.screening), with their video
    first_row_s = None  # Ray Data start-up, actor spawn, model load and the first batch
    nodes: dict[str, set[str]] = {"decode": set(), "engine": set()}  # Ray node ids each stage ran on
    previews: list[tuple[str, int, bytes]] = []  # (uri, frames, JPEG) of the first videos' segment 0
    videos = todo.select("video_id", "batch_key", "uri", "duration_s", "rotation").to_dicts()
    n_rows = 0
    served_app = None  # the vLLM application the job captioned on, when served (its rows say so)
    # Requests that overlap (vLLM's engine, a server): busy while any is in flight, not their summed latencies.
    overlapping = spec.engine.name in ("vllm", "endpoint")
    in_flight: list[tuple[float, float]] = []  # vLLM: (sent, answered) of each request, as this process saw it
    # The step drives the job; through Ray Client, a task on the cluster does (on_cluster).
    jobs = on_cluster(caption_rows, videos, spec)
    for n_rows, row in enumerate(jobs if videos else [], start=1):
        if first_row_s is None:
            first_row_s = time.perf_counter() - started
        if row["video_id"] in whole:  # a segment Ray computed twice (a retried task), after its video was written
            continue
        name = printable(row["uri"].rsplit("/", 1)[-1])
        if row["status"] == CAPTION_OK:
            log.info(
                f"[{n_rows}] {name} segment {row['segment']}: {row['output_tokens']} tokens in {row['latency_s']:.2f}s"
            )
        else:
            log.warning(f"[{n_rows}] {name}: {printable(row['error'])}")
        cpu_s += row.get("decode_s") or 0.0
        served_app = row.get("served_app") or served_app
        frame_bytes += sum(len(f) for f in row["frames"]) if row.get("frames") is not None else 0
        if overlapping:  # a request's latency, overlapping others: the engine is busy while any is in flight
            done = time.perf_counter()
            in_flight.append((done - float(row.get("engine_s") or 0.0), done))
        else:  # the transformers stage's share of its batch: shares sum to the engines' busy time
            engine_s += row.get("engine_s") or 0.0
        for stage in nodes:
            if row.get(f"{stage}_node"):
                nodes[stage].add(row[f"{stage}_node"])
        if row.get("screened"):
            screened += [{"uri": row["uri"], "segment": int(row["segment"]), **s} for s in json.loads(row["screened"])]
        if row.get("preview") and len(previews) < PREVIEW_VIDEOS:
            previews.append((row["uri"], len(row.get("frame_timestamps") or []), row["preview"]))
        segments = arrived.setdefault(row["video_id"], {})
        segments[int(row["segment"])] = row  # a segment Ray computed twice (a retried task) is kept once
        if len(segments) >= (row.get("segments") or 1):
            ready.extend(arrived.pop(row["video_id"]).values())
            whole.add(row["video_id"])
            if len(ready) >= WRITE_EVERY:
                t0 = time.perf_counter()
                written += _write(tables, ready, stamp, split, table)
                delta_s += time.perf_counter() - t0
                ready = []
    ready.extend(missing_rows(videos, arrived, whole, log))
    if overlapping:
        engine_s = covered_seconds(in_flight)
    t0 = time.perf_counter()
    written += _write(tables, ready, stamp, split, table)
    delta_s += time.perf_counter() - t0
    return {
        "written": written,
        "wall_s": time.perf_counter() - started,
        "first_row_s": first_row_s or 0.0,
        "requests": n_rows,  # segment rows the job produced
        "delta_s": delta_s,
        "cpu_s": cpu_s,
        "engine_s": engine_s,
        "nodes": {k: sorted(v) for k, v in nodes.items()},
        "previews": previews,
        "frame_bytes": frame_bytes,
        "screened": screened,
        "service": engine_service(spec, served_app),
    }


def missing_rows(videos: list[dict], arrived: dict[str, dict[int, dict]], done: set[str], log) -> list[dict]:
    """What a finished job left without a result, as rows: the segments that came back for videos that are
    not whole (``arrived``), an error row for each planned segment that did not, and one error row for a
    video that sent nothing at all (every batch holding it dropped, ``core.inference.retries``). ``done``:
    videos already whole. Nothing a job was given goes missing from the table."""
    rows: list[dict] = []
    for segments in arrived.values():
        planned = max(int(r.get("segments") or 1) for r in segments.values())
        some = next(iter(segments.values()))
        missing = [i for i in range(planned) if i not in segments]
        log.warning(f"{printable(some['uri'])}: no result for segments {missing}; written as error rows")
        rows.extend(segments.values())
        rows.extend(
            {**{k: some.get(k) for k in ("video_id", "batch_key", "uri", "segments")}, "segment": i}
            | {"frame_timestamps": [], "prose": "", "status": CAPTION_ERROR, "error": NO_RESULT}
            for i in missing
        )
    for video in videos:
        if video["video_id"] not in done and video["video_id"] not in arrived:
            log.warning(f"{printable(video['uri'])}: no result at all; written as an error row")
            rows.append(
                {k: video[k] for k in ("video_id", "batch_key", "uri")}
                | {"segment": 0, "segments": 1, "frame_timestamps": [], "prose": "", "status": CAPTION_ERROR}
                | {"error": NO_RESULT}
            )
    return rows


def _write(tables: DeltaTables, rows: list[dict], stamp: dict, split: str, table: str) -> int:
    """Write whole videos: in one commit, their rows for this model and prompt are replaced by ``rows``
    (a rerun's rows, or another split's, leave nothing stale behind)."""
    if not rows:
        return 0
    now = datetime.now(UTC)
    cols = [f.name for f in SCHEMAS[table]]
    full = [{**{c: r.get(c) for c in cols}, **stamp, "split": split, "captioned_at": now} for r in rows]
    selection = {
        "batch_key": sorted({r["batch_key"] for r in full}),  # lets Delta skip other batches' files
        "video_id": sorted({r["video_id"] for r in full}),
        "model_version": [str(stamp["model_version"])],
        "prompt_version": [int(stamp["prompt_version"])],
    }
    if table == CAPTIONS:  # first: a crash between the two commits leaves frames without captions, not the reverse
        tables.replace_where(SAMPLED_FRAMES, to_arrow(SAMPLED_FRAMES, sampled_frame_rows(rows, stamp, now)), selection)
    tables.replace_where(table, to_arrow(table, full), selection)
    return len(full)


def sampled_frame_rows(rows: list[dict], stamp: dict, now: datetime) -> list[dict]:
    """The JPEGs each ok caption row was made from (the decode stage's, ``core.media.frames``), a row each."""
    out = []
    for r in rows:
        images = r.get("frames")
        if r.get("status") != CAPTION_OK or images is None or len(images) != len(r.get("frame_timestamps") or []):
            continue
        screened = {s["frame"]: s for s in json.loads(r.get("screened") or "[]") if s.get("to_s") is not None}
        for j, (t, image) in enumerate(zip(r["frame_timestamps"], images)):
            why = screened.get(j, {})
            out.append(
                {k: r[k] for k in ("video_id", "batch_key", "uri")}
                | {"segment": int(r["segment"]), "frame": j, "timestamp_s": float(t), "image": bytes(image)}
                | {"screened": why.get("reason"), "screened_from_s": why.get("from_s")}
                | {"model_version": str(stamp["model_version"]), "prompt_version": int(stamp["prompt_version"])}
                | {"sampled_at": now}
            )
    return out


def structurer_id(settings: StructurerSettings, model_name: str, model_version: str) -> str:
    return f"{model_name}/v{model_version}" if settings.model == CAPTIONER else settings.model


def make_structurer(
    settings: StructurerSettings,
    captioner: ModelFiles | Path | str | None,
    connect_ray=None,
    warm: JobSpec | None = None,
    endpoint: dict | None = None,
):
    """The engine for ``settings`` (the captioning model's files when model is 'captioner').

    ``connect_ray()`` connects to Ray through the step's Ray resource and returns the cluster's GPU
    count; it is called only when vLLM could run (asked for, or ``auto`` with vLLM installed), so the
    CPU default never starts Ray for structuring. Without it, the GPUs this process sees decide.
    ``warm``: the captions step's served engine (the step joined a Ray that outlives it); the
    'captioner' structurer on transformers then runs on that replica's loaded model, on its device,
    instead of loading the model again here. ``endpoint``: the captioning model is an endpoint
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
    if requested == "vllm" or (requested == "auto" and vllm_importable()):
        gpus = connect_ray() if connect_ray is not None else cluster_gpus()
    if choose_engine_name(settings.engine, gpus=gpus, has_vllm=cluster_has_vllm) == "vllm":
        if warm is not None and warm.engine.name == "vllm" and settings.model == CAPTIONER:
            from video_assets.core.serving import llm

            if llm.served(warm):
                return llm.ServedLlmStructurer(warm, settings.batch_size)
        from video_assets.core.structuring.engines import VllmStructurer

        return VllmStructurer(settings.vllm_settings(model), files if settings.model == CAPTIONER else None)
    if warm is not None and warm.engine.name == "transformers" and settings.model == CAPTIONER:
        from video_assets.core.serving.captioner import ServedStructurer

        return ServedStructurer(warm, settings.batch_size)
    from video_assets.core.structuring.engines import TransformersStructurer

    # Loaded in this process: the registered model's weights fetched here (the step resolved its small files).
    local = files.here() if settings.model == CAPTIONER else model
    return TransformersStructurer(local, settings.device, settings.batch_size)


def structure_rows(
    engine, settings: StructurerSettings, uc: uc_mod.UseCase, caption_rows: list[dict], structurer: str, log=None
) -> list[dict]:
    """structured_events rows for caption rows (dicts of the captions table), one per caption."""
    now = datetime.now(UTC)
    results = structure_captions(engine, uc, caption_rows, settings.max_new_tokens, settings.retry_max_new_tokens)
    out = []
    for n, (c, r) in enumerate(zip(caption_rows, results), start=1):
        if log is not None:
            name = printable(c["uri"].rsplit("/", 1)[-1])
            log.info(
                f"[{n}/{len(caption_rows)}] {uc.name} {name} segment {c['segment']}: {r['status']}"
                + (f" {r['verdict']}" if r["verdict"] else "")
                + (f" ({printable(r['error'])})" if r["error"] else "")
            )
        out.append(
            {
                "video_id": c["video_id"],
                "segment": c["segment"],
                "use_case": uc.name,
                "model_version": c["model_version"],
                "prompt_version": c["prompt_version"],
                "use_case_version": uc.version,
                "structurer": structurer,
                "batch_key": c["batch_key"],
                "uri": c["uri"],
                "segment_start_s": c.get("segment_start_s"),
                "segment_end_s": c.get("segment_end_s"),
                # plan_structuring's rows carry it; plain caption rows (any other caller) get it here
                "caption_digest": c.get("caption_digest") or caption_digest(c),
                **r,
                "n_events": len(r["events"]),
                "structured_at": now,
            }
        )
    return out


def write_structured(
    tables: DeltaTables,
    table: str,
    plan: StructuringPlan,
    new_rows: list[dict],
    model_version: str,
    prompt_version: int,
) -> int:
    """The plan's affected videos' rows of one caption pair replaced in one commit (as captions replaces
    a video's rows): kept rows that still match their caption plus ``new_rows``; stale rows are gone.
    Rows written."""
    if not plan.affected:
        return 0
    rows = plan.rows(new_rows, KEYS[table])
    selection = {"video_id": plan.affected, "model_version": [model_version], "prompt_version": [prompt_version]}
    tables.replace_where(table, to_arrow(table, rows), selection)
    return len(rows)
