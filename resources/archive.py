"""Which models make the searchable archive (speech, frame and text encoders), where they come from, and
how much hardware their stages get.

Defaults run offline on a laptop CPU with models that ship as Python packages (Whisper base, CTranslate2
build; EfficientNet-Lite0; all-MiniLM-L6-v2). A real deployment points a source at a larger model (a
local folder, or a hub id fetched once into ``cache_dir``) and gives the actors GPUs; nothing else changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from resources.vlm import folder_digest, looks_like_path
from video_assets.core.embeddings.job import EFFICIENTNET_LITE0
from video_assets.core.inference.stages import StageSpec
from video_assets.core.models.folders import build_once

SPEECH, FRAMES, TEXT = "speech", "frames", "text"
KINDS = (SPEECH, FRAMES, TEXT)
PACKAGED = {
    SPEECH: "package:whisper-base",
    FRAMES: "package:efficientnet-lite0",
    TEXT: "package:all-MiniLM-L6-v2",
}


# GPU share of one actor of a packaged model when the cluster has GPUs: Whisper base, EfficientNet-Lite0
# and MiniLM need a few hundred MB and a sliver of a GPU's compute, so four actors share one GPU instead
# of each reserving a whole one. A model the user points a source at gets a whole GPU (num_gpus overrides).
PACKAGED_GPU_SHARE = 0.25


class ArchiveSettings(ConfigurableResource):
    speech_model_source: str = Field(
        default=PACKAGED[SPEECH],
        description=f"'{PACKAGED[SPEECH]}' (bundled Whisper base), a local folder of a CTranslate2 Whisper, "
        "or a hub id of one (e.g. Systran/faster-whisper-large-v3)",
    )
    frame_encoder_source: str = Field(
        default=PACKAGED[FRAMES],
        description=f"'{PACKAGED[FRAMES]}' (frame-to-frame similarity only), or a CLIP/SigLIP-style folder or "
        "hub id (then text queries can hit frames)",
    )
    text_encoder_source: str = Field(default=PACKAGED[TEXT], description="a sentence-transformers folder or hub id")
    registered_prefix: str = Field(default="archive", description="MLflow names: <prefix>-speech, -frames, -text")
    alias: str = Field(default="production", description="Alias the archive assets load")
    cache_dir: str = Field(description="Where models are assembled, downloaded and unpacked")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where the model actors run")
    speech_compute_type: str = Field(
        default="default", description="CTranslate2 compute type; default: int8 on CPU, float16 on CUDA"
    )
    speech_vad: bool = Field(default=True, description="Voice-activity filter: no words invented on silence or noise")
    speech_language: str | None = Field(default=None, description="Force a language (e.g. 'en'); None detects it")
    frame_ocr: bool = Field(default=False, description="Read on-screen text of every embedded frame (rapidocr)")
    cpu_concurrency: int = Field(default=2, ge=1, description="Parallel decode tasks (1 CPU each)")
    concurrency: int = Field(default=1, ge=1, description="Actors per model stage (each holds one model)")
    num_gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs per model actor; unset, when the cluster has GPUs and device != cpu: 0.25 for a "
        "packaged model (four share a GPU), 1 for a model from a source",
    )
    frame_batch_size: int = Field(default=32, ge=1, description="Frames per encoder call")
    text_batch_size: int = Field(default=64, ge=1, description="Texts per encoder call")

    def actor_placement(self, cluster_gpus: float | None, kind: str) -> tuple[str, float]:
        """(device, GPUs per actor) of ``kind``'s model actors: GPUs are reserved in Ray only when the
        cluster has some and the device allows (a fraction for a packaged model); ``auto`` then means cuda."""
        gpus = self.num_gpus
        if gpus is None:
            share = PACKAGED_GPU_SHARE if self.source(kind) == PACKAGED[kind] else 1.0
            gpus = share if self.device != "cpu" and (cluster_gpus or 0) > 0 else 0.0
        device = self.device if self.device != "auto" else ("cuda" if gpus > 0 else "cpu")
        return device, gpus

    def stage_spec(self, cluster_gpus: float | None, batch_size: int, kind: str) -> tuple[StageSpec, str]:
        """The Ray job shape of ``kind``'s archive stage (decode width, model actors and their GPUs), and the
        actors' device."""
        device, gpus = self.actor_placement(cluster_gpus, kind)
        return StageSpec(self.cpu_concurrency, self.concurrency, gpus, batch_size), device

    def registered_model(self, kind: str) -> str:
        return f"{self.registered_prefix}-{kind}"

    def source(self, kind: str) -> str:
        return {SPEECH: self.speech_model_source, FRAMES: self.frame_encoder_source, TEXT: self.text_encoder_source}[
            kind
        ]

    def materialize_source(self, kind: str) -> tuple[Path, str]:
        """A local folder holding the ``kind`` model, and a fingerprint of its exact content."""
        source = self.source(kind)
        if source.startswith("package:"):
            if source != PACKAGED[kind]:
                raise ValueError(f"unknown packaged {kind} model {source!r}; the bundled one is {PACKAGED[kind]!r}")
            folder = assemble_packaged(kind, Path(self.cache_dir) / "archive" / source.removeprefix("package:"))
            return folder, f"{source}:{folder_digest(folder)}"
        local = Path(source).expanduser()
        if local.exists():
            return local.resolve(), f"local:{folder_digest(local)}"
        if looks_like_path(source):
            raise FileNotFoundError(f"{kind} model folder {local} does not exist ({_setting(kind)})")
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source, cache_dir=str(Path(self.cache_dir) / "hub")))
        except Exception as exc:
            raise RuntimeError(
                f"could not fetch {kind} model {source!r} from the hub: {exc.__class__.__name__}: {exc}. "
                f"Point {_setting(kind)} at a local folder when offline."
            ) from exc
        return path, f"hub:{source}@{path.name}"


def _setting(kind: str) -> str:
    return {SPEECH: "SPEECH_MODEL_SOURCE", FRAMES: "FRAME_ENCODER_SOURCE", TEXT: "TEXT_ENCODER_SOURCE"}[kind]


def assemble_packaged(kind: str, dest: Path) -> Path:
    """The bundled model of ``kind`` as a plain folder under ``dest`` (built once; a later call finds it)."""
    if kind == SPEECH:
        from video_assets.core.transcription.whisper import assemble_packaged_whisper

        return assemble_packaged_whisper(dest)
    if kind == TEXT:
        from video_assets.core.embeddings.text import packaged_minilm_dir

        src = packaged_minilm_dir()
        return build_once(dest, _has_config, lambda tmp: shutil.copytree(src, tmp, dirs_exist_ok=True))
    from video_assets.core.embeddings.frames import packaged_efficientnet_weights

    weights = packaged_efficientnet_weights()

    def build(tmp: Path) -> None:
        shutil.copyfile(weights, tmp / weights.name)
        # A config.json like every other model folder's: what the encoder is, which file holds it.
        meta = {"model_type": EFFICIENTNET_LITE0, "weights": weights.name, "licence": "Apache-2.0"}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))

    return build_once(dest, _has_config, build)


def _has_config(folder: Path) -> bool:
    """A bundled model folder is there (``build_once`` renames it into place whole)."""
    return (folder / "config.json").is_file()
