"""Models stage assets: the captioning VLM in the MLflow registry and the versioned caption prompt."""

from pathlib import Path

from dagster import AssetExecutionContext, Config, DataVersion, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from resources.archive import FRAMES, SPEECH, TEXT, ArchiveSettings
from resources.mlflow_registry import MlflowRegistry
from resources.vlm import VlmSettings
from video_assets.defs.common import TRANSIENT_RETRY, stage_asset
from video_assets.defs.registry import (
    ARCHIVE_MODEL_ASSETS,
    CAPTION_PROMPT_FILE,
    CAPTION_PROMPT_NAME,
    CHALLENGER,
    TINY_WARNING,
)


class RegistrationConfig(Config):
    skip_gate: bool = Field(
        default=False,
        description="Put a new version straight behind production instead of behind challenger "
        "(the promotion job then has nothing to evaluate)",
    )


def _size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# Idempotent (a version is keyed by the source's fingerprint, the alias placement re-derived): retried
# on transient MLflow or storage errors.
@asset(
    **stage_asset("models", kinds=("mlflow",)),
    retry_policy=TRANSIENT_RETRY,
    description="The captioning VLM registered in MLflow in path form. The first version goes behind "
    "`production`; a later new version behind `challenger`, for the promote_challenger job to evaluate. "
    "Idempotent: the same source and revision does not create a new version.",
)
def vlm_model(
    context: AssetExecutionContext, config: RegistrationConfig, vlm: VlmSettings, mlflow_registry: MlflowRegistry
) -> MaterializeResult:
    try:
        folder, fingerprint = vlm.materialize_source()
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # a bad or unfetchable source: a retry cannot fix it
        raise Failure(str(exc), allow_retries=False) from exc
    registered = mlflow_registry.register_model_folder(
        folder,
        name=vlm.registered_model,
        alias=vlm.alias,
        source=vlm.registered_source,
        fingerprint=fingerprint,
        tags={"revision": vlm.model_revision or ""},
        set_alias=False,
        # An endpoint's version is its config.json alone (``VlmSettings.materialize_source``): logged as it is.
        flavor="files" if vlm.uses_endpoint else "transformers",
    )
    alias = mlflow_registry.place_new_version(
        "model", vlm.registered_model, registered.version, vlm.alias, CHALLENGER, config.skip_gate
    )
    verb = "registered as new version" if registered.created else "already registered as version"
    context.log.info(
        f"{vlm.registered_source}: {verb} {registered.version}; models:/{vlm.registered_model}@{alias} -> v{registered.version}"
    )
    if alias == CHALLENGER:
        context.log.info("run the promote_challenger job to evaluate it against production on the golden set")
    if vlm.is_tiny:
        context.log.warning(TINY_WARNING)
    # The data version is the version in production, what the per-batch steps resolve: a challenger changes
    # nothing downstream until it is promoted (the promotion then reports the new one, reprocess.py).
    production = mlflow_registry.alias_version("model", vlm.registered_model, vlm.alias) or registered.version
    return MaterializeResult(
        data_version=DataVersion(f"v{production}"),
        metadata={
            "model_uri": MetadataValue.text(f"models:/{vlm.registered_model}@{alias}"),
            "alias": MetadataValue.text(alias),
            "version": MetadataValue.text(registered.version),
            "source": MetadataValue.text(vlm.registered_source),
            "fingerprint": MetadataValue.text(fingerprint),
            "size_bytes": MetadataValue.int(_size_bytes(folder)),
            "new_version": MetadataValue.bool(registered.created),
            "tracking_uri": MetadataValue.text(mlflow_registry.tracking_uri),
            **({"warning": MetadataValue.text(TINY_WARNING)} if vlm.is_tiny else {}),
        },
    )


# Idempotent (a new version only when the text changed): retried on transient MLflow errors.
@asset(
    **stage_asset("models", kinds=("mlflow",)),
    retry_policy=TRANSIENT_RETRY,
    description="The caption prompt (video_assets/prompts/caption.txt) in the MLflow prompt registry; "
    "a new version only when the text changes. The first version goes behind `production`, a later one "
    "behind `challenger` (see vlm_model).",
)
def caption_prompt(
    context: AssetExecutionContext, config: RegistrationConfig, vlm: VlmSettings, mlflow_registry: MlflowRegistry
) -> MaterializeResult:
    template = CAPTION_PROMPT_FILE.read_text().strip()
    prompt = mlflow_registry.register_prompt(CAPTION_PROMPT_NAME, template, alias=None)
    alias = mlflow_registry.place_new_version(
        "prompt", CAPTION_PROMPT_NAME, prompt.version, vlm.alias, CHALLENGER, config.skip_gate
    )
    context.log.info(
        f"prompts:/{CAPTION_PROMPT_NAME}@{alias} -> version {prompt.version} ({'new' if prompt.created else 'unchanged'})"
    )
    production = mlflow_registry.alias_version("prompt", CAPTION_PROMPT_NAME, vlm.alias) or prompt.version
    return MaterializeResult(
        data_version=DataVersion(f"v{production}"),  # the version in production (see vlm_model)
        metadata={
            "prompt_uri": MetadataValue.text(f"prompts:/{CAPTION_PROMPT_NAME}@{alias}"),
            "alias": MetadataValue.text(alias),
            "version": MetadataValue.int(prompt.version),
            "new_version": MetadataValue.bool(prompt.created),
            "template": MetadataValue.md(f"```\n{template}\n```"),
        },
    )


def _archive_model_asset(kind: str, what: str):
    """The registration asset of one archive model (speech, frame or text encoder)."""

    # Idempotent like vlm_model. No challenger gate: an encoder has no golden set to be scored on, so a
    # new version goes straight behind the alias, and the archive assets re-embed exactly the rows it made.
    @asset(
        name=ARCHIVE_MODEL_ASSETS[kind],
        **stage_asset("models", kinds=("mlflow",)),
        retry_policy=TRANSIENT_RETRY,
        description=f"The {what} registered in MLflow (files as they are); a new source or content is a new "
        "version behind the alias, the same content is not.",
    )
    def _register(context: AssetExecutionContext, archive: ArchiveSettings, mlflow_registry: MlflowRegistry):
        try:
            folder, fingerprint = archive.materialize_source(kind)
        except (ValueError, FileNotFoundError, RuntimeError, ImportError) as exc:
            raise Failure(str(exc), allow_retries=False) from exc
        name = archive.registered_model(kind)
        registered = mlflow_registry.register_model_folder(
            folder,
            name=name,
            alias=archive.alias,
            source=archive.source(kind),
            fingerprint=fingerprint,
            experiment="archive-models",
            flavor="files",
        )
        verb = "registered as new version" if registered.created else "already registered as version"
        context.log.info(f"{archive.source(kind)}: {verb} {registered.version}; models:/{name}@{archive.alias}")
        return MaterializeResult(
            data_version=DataVersion(f"v{registered.version}"),
            metadata={
                "model_uri": MetadataValue.text(f"models:/{name}@{archive.alias}"),
                "version": MetadataValue.text(registered.version),
                "source": MetadataValue.text(archive.source(kind)),
                "fingerprint": MetadataValue.text(fingerprint),
                "size_bytes": MetadataValue.int(_size_bytes(folder)),
                "new_version": MetadataValue.bool(registered.created),
            },
        )

    return _register


speech_model = _archive_model_asset(SPEECH, "speech-to-text model (Whisper, CTranslate2 build)")
frame_encoder = _archive_model_asset(FRAMES, "frame encoder (image embeddings)")
text_encoder = _archive_model_asset(TEXT, "text encoder (sentence embeddings)")
ARCHIVE_MODELS = [speech_model, frame_encoder, text_encoder]
