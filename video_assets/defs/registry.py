"""What the MLflow registry names, stated once for every stage: the caption prompt's name and file, the
challenger alias, and the archive models' versions and files behind their alias. Where captions resolve
the production alias is `engines.resolve_caption_model`; every other stage takes versions from lineage."""

from pathlib import Path

from dagster import Failure

from resources.archive import FRAMES, SPEECH, TEXT, ArchiveSettings
from resources.mlflow_registry import MlflowRegistry, RegistryError, is_not_found

CAPTION_PROMPT_NAME = "video-caption"
CAPTION_PROMPT_FILE = Path(__file__).resolve().parents[1] / "prompts" / "caption.txt"
CHALLENGER = "challenger"
TINY_WARNING = (
    "TINY RANDOM TEST MODEL: captions are nonsense. Set VLM_MODEL_SOURCE to a hub id "
    "(e.g. Qwen/Qwen2.5-VL-7B-Instruct) or a local folder of real weights."
)
ARCHIVE_MODEL_ASSETS = {SPEECH: "speech_model", FRAMES: "frame_encoder", TEXT: "text_encoder"}


def archive_model_files(
    mlflow_registry: MlflowRegistry, archive: ArchiveSettings, kind: str, version: str | None = None
):
    """(ModelFiles, version) of the ``kind`` model behind the alias (or of ``version``, the one lineage
    names), downloaded for this step; a Failure that says what to run when it is not registered."""
    from mlflow.exceptions import MlflowException

    name = archive.registered_model(kind)
    dest = Path(archive.cache_dir) / "registry"
    try:
        if version is not None:
            found = mlflow_registry.client().get_model_version(name, version)
            return mlflow_registry.version_files(found, dest, archive.cache_dir)
        return mlflow_registry.model_files(name, archive.alias, dest, archive.cache_dir)
    except MlflowException as exc:
        if not is_not_found(exc):
            raise RegistryError(f"MLflow registry error resolving models:/{name}@{archive.alias}: {exc}") from exc
        raise Failure(
            f"no models:/{name}@{archive.alias} in {mlflow_registry.tracking_uri}: materialise "
            f"{ARCHIVE_MODEL_ASSETS[kind]} (job register_model) first.",
            allow_retries=False,
        ) from exc
