"""Benchmark section: verify once, and a step's model fetch without the weights (issue 39, item 6).

A synthetic 2 GB model folder (random weights in two shards, a tokenizer and configs of a small VLM's
sizes) is registered in a real local MLflow store the way the product registers a model (manifest, files
digest tag), then fetched the way a step fetches it:

- the second use of the verified folder (a step resolving the same version again: a stamp check) vs the
  first hash of the folder (every file read and hashed, what each use cost before). Target <= 1 %;
- a step that does not run the engine (``version_files`` without weights) vs the whole model: bytes
  fetched onto this machine. Target <= 5 MB of the 2 GB.

    .venv/bin/python -m scripts.bench.models
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

SHARD = 1_000_000_000  # two shards: 2 GB of weights
CHUNK = 50_000_000
REPEATS = 5
# The small files of a small VLM (sizes as in SmolVLM's repository): what a step needs without the engine.
LIGHT_FILES = {
    "config.json": 4 << 10,
    "generation_config.json": 200,
    "preprocessor_config.json": 1 << 10,
    "processor_config.json": 100,
    "chat_template.json": 2 << 10,
    "special_tokens_map.json": 1 << 10,
    "tokenizer_config.json": 20 << 10,
    "tokenizer.json": 3500 << 10,
}


def _synthetic_model(folder: Path) -> int:
    """A model folder of ``2 * SHARD`` bytes of random weights plus ``LIGHT_FILES``; returns its size."""
    import numpy as np

    rng = np.random.default_rng(39)
    folder.mkdir(parents=True)
    for name, size in LIGHT_FILES.items():
        filler = rng.bytes(size).hex()[: max(0, size - 20)]
        (folder / name).write_text(json.dumps({"name": name, "x": filler}))
    for shard in (1, 2):
        with open(folder / f"model-0000{shard}-of-00002.safetensors", "wb") as f:
            for _ in range(SHARD // CHUNK):
                f.write(rng.bytes(CHUNK))
    return sum(p.stat().st_size for p in folder.iterdir())


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def rows(clips=None, work: Path | None = None) -> list[dict]:
    from resources.mlflow_registry import FILES_TAG, MlflowRegistry
    from video_assets.core.inference.model_cache import HASHED, cache_root, verify_files

    parent = Path(work or tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="models-", dir=parent))
    try:
        size = _synthetic_model(root / "src")
        reg = MlflowRegistry(tracking_uri=f"sqlite:///{root}/mlflow.db", artifact_root=str(root / "art"))
        reg.register_model_folder(root / "src", "bench-2gb", "production", "synthetic", "fp-1", flavor="files")
        version = reg.resolve_alias("bench-2gb", "production")

        # A step that does not run the engine: the version resolved without its weights.
        before = HASHED.copy()
        t0 = time.perf_counter()
        light, _ = reg.version_files(version, root / "light", str(root / "nodes"), weights=False)
        light_s = time.perf_counter() - t0
        light_bytes = _size(cache_root(Path(light.path)))
        light_hashed = HASHED["bytes"] - before["bytes"]

        # The whole model, downloaded and verified (every file hashed once, then stamped).
        t0 = time.perf_counter()
        files, _ = reg.version_files(version, root / "dl", str(root / "nodes"), weights=True)
        fetch_s = time.perf_counter() - t0
        target = cache_root(Path(files.path))

        # The first hash: the folder read and hashed in full, what every use cost before stamps.
        before = HASHED.copy()
        t0 = time.perf_counter()
        verify_files(target, version.tags[FILES_TAG], reverify_after_s=0, stamps=False)
        first_s = time.perf_counter() - t0
        first_bytes = HASHED["bytes"] - before["bytes"]

        # Later uses: the step resolving the version again, and an engine's here() on this machine.
        uses, here = [], []
        before = HASHED.copy()
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            reg.version_files(version, root / "dl", str(root / "nodes"), weights=True)
            uses.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            files.here()
            here.append(time.perf_counter() - t0)
        second_s, here_s = statistics.median(uses), statistics.median(here)
        later_bytes = HASHED["bytes"] - before["bytes"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [
        {
            "measurement": f"second use of a verified {_mb(size)} model folder (stamp check)",
            "ours_s": second_s,
            "ours_text": _ms(second_s),
            "baseline": "the first hash of the folder (every file read and hashed)",
            "baseline_s": first_s,
            "ratio": second_s / first_s,
            "target": "<= 0.01",
            "note": f"median of {REPEATS}; bytes hashed by the {2 * REPEATS} later uses: {later_bytes}; an "
            f"engine's here(): {_ms(here_s)}; first hash {_mb(first_bytes)} from the page cache (a cold read is "
            f"slower); download + verify {fetch_s:.1f} s",
        },
        {
            "measurement": f"a step that does not run the engine: bytes fetched of a {_mb(size)} model",
            "ours_s": light_s,
            "ours_text": _mb(light_bytes),
            "baseline": "the whole model",
            "baseline_s": fetch_s,
            "baseline_text": _mb(size),
            "ratio": light_bytes / size,
            "target": "<= 5 MB (0.0025)",
            "note": f"config, tokenizer, processor files and manifest, in {light_s:.2f} s (whole model "
            f"{fetch_s:.1f} s); {_mb(light_hashed)} hashed",
        },
    ]


if __name__ == "__main__":
    for r in rows():
        print(
            f"{r['measurement']}: {r.get('ours_text') or r['ours_s']} vs {r.get('baseline_text') or r['baseline_s']}"
            f" = {r['ratio']:.4f} (target {r['target']})"
        )
