"""A Ray actor on a node without the step's model folder downloads the registered artifact itself,
once per node: concurrent actors wait on one download."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resources.mlflow_registry import MlflowRegistry
from resources.vlm import TINY_MODEL_SOURCE
from video_assets.core.inference.model_cache import local_model

# An "actor" in its own process: counts real downloads in a shared file, then resolves the model.
ACTOR = """
import json, sys
import mlflow.artifacts
real = mlflow.artifacts.download_artifacts
def counting(**kw):
    with open(sys.argv[3], "a") as f:
        f.write("download\\n")
    return real(**kw)
mlflow.artifacts.download_artifacts = counting
from video_assets.core.inference.model_cache import local_model
print(json.dumps(local_model("/nonexistent/model", sys.argv[1], sys.argv[2], sys.argv[4])))
"""


@pytest.fixture(scope="module")
def registered(tiny_model_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    reg = MlflowRegistry(tracking_uri=f"sqlite:///{root}/mlflow.db", artifact_root=str(root / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    return reg, reg.artifact_uri("captioner", "production")


def test_concurrent_actors_download_once(registered, tmp_path):
    reg, uri = registered
    counter = tmp_path / "downloads.txt"
    node_cache = tmp_path / "node"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ACTOR, uri, str(node_cache), str(counter), reg.tracking_uri],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    paths = {json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and (Path(paths.pop()) / "config.json").exists()
    assert counter.read_text().count("download") == 1
    # Later actors on this node find it complete without any download.
    assert local_model("/nonexistent/model", uri, str(node_cache)).startswith(str(node_cache))
    assert counter.read_text().count("download") == 1


def test_the_steps_own_folder_wins_where_it_exists(registered, tmp_path, tiny_model_cache):
    _, uri = registered
    here = str(tiny_model_cache / TINY_MODEL_SOURCE)
    assert local_model(here, uri, str(tmp_path)) == here
    assert not (tmp_path / "node-models").exists()
    with pytest.raises(FileNotFoundError, match="not on this node and no artifact URI"):
        local_model("/nonexistent/model", None, str(tmp_path))


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_model_file_changed_by_one_byte_is_refused_naming_the_file(tiny_model_cache, tmp_path):
    """Registration logs every file's sha256 (SHA256SUMS.json, its own digest a version tag); a download
    and every later use of the cached copy are checked against it: one byte changed in the cache, or in
    the artifact store, is refused with the file and both digests named, never loaded."""
    from video_assets.core.inference.model_cache import MANIFEST, ModelFilesChanged

    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    version = reg.resolve_alias("captioner", "production")
    assert len(version.tags["files_sha256"]) == 64
    files, _ = reg.model_files("captioner", "production", tmp_path / "dl", node_cache_dir=str(tmp_path / "nodes"))
    assert files.files_sha256 == version.tags["files_sha256"]
    assert files.here() == files.path  # the step fetched the small files; an engine here adds the weights
    weights = max(Path(files.path).rglob("*.safetensors"), key=lambda p: p.stat().st_size)

    _flip_one_byte(weights)  # the cached copy, changed on disk
    with pytest.raises(ModelFilesChanged) as err:
        reg.model_files("captioner", "production", tmp_path / "dl", node_cache_dir=str(tmp_path / "nodes"))
    assert str(weights) in str(err.value) and "registered" in str(err.value)
    _flip_one_byte(weights)  # back: accepted again
    reg.model_files("captioner", "production", tmp_path / "dl", node_cache_dir=str(tmp_path / "nodes"))

    # An extra file beside the weights (code a loader might run) is refused too.
    (weights.parent / "extra.py").write_text("print('hi')")
    with pytest.raises(ModelFilesChanged, match="extra.py: not a file of the registered model"):
        reg.model_files("captioner", "production", tmp_path / "dl", node_cache_dir=str(tmp_path / "nodes"))

    # The artifact store's copy changed: a fresh download is refused and never becomes the cache.
    stored = max((tmp_path / "art").rglob(weights.name), key=lambda p: p.stat().st_size)
    _flip_one_byte(stored)
    with pytest.raises(ModelFilesChanged, match=weights.name):
        reg.model_files("captioner", "production", tmp_path / "fresh", str(tmp_path / "nodes"), weights=True)
    assert not any((tmp_path / "fresh").glob("*/.complete"))
    fresh, _ = reg.model_files("captioner", "production", tmp_path / "fresh", node_cache_dir=str(tmp_path / "nodes"))
    with pytest.raises(ModelFilesChanged, match=weights.name):  # the small files are intact; the weights are not
        fresh.here()
    assert not any((tmp_path / "fresh").glob("*/.complete")) and not list((tmp_path / "fresh").rglob(weights.name))
    # On another node (a Ray actor's own download), the same check.
    with pytest.raises(ModelFilesChanged):
        local_model("/nonexistent", files.artifact_uri, str(tmp_path / "node2"), files.tracking_uri, files.files_sha256)
    assert len(list((tmp_path / "dl").rglob(MANIFEST))) == 1  # downloaded with the files it lists


def test_a_node_that_cannot_read_the_embedded_store_says_which_setting_to_change(tmp_path):
    """A worker on another machine downloading from the embedded store (a SQLite file and an artifact
    folder on the Dagster machine: here, paths that do not exist) gets an error naming MLFLOW_TRACKING_URI
    and the docs, not a bare file-not-found; an object-store URI is never blamed on the setting."""
    from video_assets.core.inference.model_cache import ModelStoreUnreachable, machine_local

    with pytest.raises(ModelStoreUnreachable, match="MLFLOW_TRACKING_URI=sqlite:///.*scale-out.md") as err:
        local_model(
            str(tmp_path / "not-here"),
            str(tmp_path / "elsewhere" / "artifacts" / "model"),
            str(tmp_path / "cache"),
            f"sqlite:///{tmp_path}/elsewhere/mlflow.db",
        )
    assert "cannot read the registered model" in str(err.value)
    cached = tmp_path / "cache" / "node-models"
    assert not [p for p in cached.iterdir() if not p.name.startswith(".")]  # no model folder, only its lock
    assert machine_local("/srv/mlartifacts/1") and machine_local("file:///srv/a") and machine_local(None)
    assert not machine_local("s3://bucket/a") and not machine_local("mlflow-artifacts:/1/a")
    assert not machine_local("http://mlflow:5000")


def test_a_stage_fetches_only_what_it_opens_and_an_engine_adds_the_weights(tiny_model_cache, tmp_path):
    """``fetch_on_node``: a CPU stage (tokenizer, chat template, processor) gets the registered model's small
    files, checked against the manifest, and no weights; an engine on the same node adds the weights to the
    same folder; a changed small file is refused as a changed weight would be."""
    from video_assets.core.inference.model_cache import (
        COMPLETE,
        LIGHT,
        ModelFiles,
        ModelFilesChanged,
        fetch_on_node,
        node_cache_path,
    )

    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    version = reg.resolve_alias("captioner", "production")
    files = ModelFiles(
        "/not/on/this/node", version.source, str(tmp_path / "cache"), reg.tracking_uri, version.tags["files_sha256"]
    )
    root = node_cache_path(version.source, files.cache_dir)

    light = Path(fetch_on_node(files, weights=False))
    names = {p.name for p in light.rglob("*") if p.is_file()}
    assert {"config.json", "tokenizer.json", "processor_config.json"} <= names
    assert not [n for n in names if n.endswith(".safetensors")] and (root / LIGHT).exists()
    assert not (root / COMPLETE).exists()

    full = Path(fetch_on_node(files, weights=True))
    assert full == light and (full / "model.safetensors").exists() and (root / COMPLETE).exists()
    assert fetch_on_node(files, weights=False) == str(full)  # a node with the whole model has the small files

    _flip_one_byte(full / "tokenizer.json")
    with pytest.raises(ModelFilesChanged, match="tokenizer.json"):
        fetch_on_node(files, weights=False)


def test_ray_data_llm_stages_are_made_to_fetch_the_model_where_they_start(tiny_model_cache, tmp_path):
    """``fetch_in_stages`` on the stages of a real ``ray.data.llm`` vLLM processor (built, not run: no vLLM
    here): every stage's actor class becomes one that fetches the model first, the engine all of it, under
    the class name Ray names its operators and actors by; constructing a CPU stage's class here fetches the
    small files, then runs Ray's own constructor on them."""
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from video_assets.core.inference.model_cache import ModelFiles, fetch_in_stages, node_cache_path

    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    version = reg.resolve_alias("captioner", "production")
    files = ModelFiles(
        "/nowhere", version.source, str(tmp_path / "cache"), reg.tracking_uri, version.tags["files_sha256"]
    )
    import ray

    from resources.settings import embedded_ray_auth

    # The product's embedded Ray (token, no metrics exporter): build_processor would start a plain one otherwise.
    with embedded_ray_auth():
        ray.init(num_cpus=1, include_dashboard=False)
        try:
            processor = build_processor(
                vLLMEngineProcessorConfig(
                    model_source=str(tiny_model_cache / TINY_MODEL_SOURCE),
                    chat_template_stage=True,
                    tokenize_stage=True,
                )
            )
        finally:
            ray.shutdown()
    before = {name: stage.fn for name, stage in processor.stages.items()}
    fetch_in_stages(processor.stages, files, ("vLLMEngineStage",))
    assert list(processor.stages) == list(before) and "vLLMEngineStage" in before
    for name, stage in processor.stages.items():
        assert stage.fn is not before[name] and issubclass(stage.fn, before[name])
        assert stage.fn.__name__ == before[name].__name__

    assert not node_cache_path(files.artifact_uri, files.cache_dir).exists()
    # A CPU stage's actor, as Ray would construct it on a node: the small files fetched first, then Ray's own
    # constructor (given the step's folder here, so it runs whatever this node's cache holds).
    udf = processor.stages["TokenizeStage"].fn(
        data_column="__data", expected_input_keys=None, model=str(tiny_model_cache / TINY_MODEL_SOURCE)
    )
    assert udf.tokenizer is not None
    cached = node_cache_path(files.artifact_uri, files.cache_dir)
    assert list(cached.rglob("tokenizer.json")) and not list(cached.rglob("*.safetensors"))


def _registered_tiny(tiny_model_cache, tmp_path) -> MlflowRegistry:
    reg = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"))
    reg.register_model_folder(tiny_model_cache / TINY_MODEL_SOURCE, "captioner", "production", "tiny", "fp-1")
    return reg


def test_a_verified_model_is_hashed_once_and_a_changed_file_again(tiny_model_cache, tmp_path, monkeypatch):
    """Verify once: the first fetch hashes every file and stamps it (size, mtime, ctime, inode, sha256);
    later uses (the step's, ``here()``) read no file; a file changed by one byte, even with its size and
    mtime put back, is hashed again and refused; a stamp older than VIDEO_MODEL_REVERIFY_DAYS is hashed
    again; and VIDEO_MODEL_REVERIFY_DAYS=0 (the full re-verify) catches what a forged stamp hides."""
    from video_assets.core.inference.model_cache import HASHED, MANIFEST, STAMPS, ModelFilesChanged

    reg = _registered_tiny(tiny_model_cache, tmp_path)

    def use(weights=True):
        return reg.model_files("captioner", "production", tmp_path / "dl", str(tmp_path / "nodes"), weights)[0]

    files = use()
    weights = max(Path(files.path).rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    [stamps] = (tmp_path / "dl").rglob(STAMPS)
    [manifest] = (tmp_path / "dl").rglob(MANIFEST)
    rel = weights.relative_to(manifest.parent).as_posix()
    assert rel in json.loads(stamps.read_text())["files"] and not list(Path(files.path).rglob(STAMPS))

    before = HASHED.copy()
    for _ in range(3):
        assert use().here() == files.path and use(weights=False).path == files.path
    assert HASHED == before  # no file read again: not the weights, not the small files
    assert not (tmp_path / "nodes").exists()  # here() used the step's verified folder

    size, mtime = weights.stat().st_size, weights.stat().st_mtime_ns
    _flip_one_byte(weights)
    os.utime(weights, ns=(weights.stat().st_atime_ns, mtime))  # size and mtime as stamped
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (size, mtime)
    before = HASHED.copy()
    with pytest.raises(ModelFilesChanged, match=f"{weights}: sha256"):
        use()
    assert HASHED["files"] - before["files"] == 1 and HASHED["bytes"] - before["bytes"] == size  # that file only

    # A stamp forged to match the changed file (a change the stamp cannot see): trusted by a stamp check,
    # refused by the full re-verify.
    forged = json.loads(stamps.read_text())
    st = weights.stat()
    forged["files"][rel][:4] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    stamps.write_text(json.dumps(forged))
    assert use().path == files.path
    monkeypatch.setenv("VIDEO_MODEL_REVERIFY_DAYS", "0")
    with pytest.raises(ModelFilesChanged, match=f"{weights}: sha256"):
        use()
    # The setting travels in ModelFiles, so a Ray worker's here() re-verifies in full too.
    assert reg.model_files("captioner", "production", tmp_path / "x", "")[0].reverify_after_s == 0.0

    _flip_one_byte(weights)  # back as registered
    monkeypatch.setenv("VIDEO_MODEL_REVERIFY_DAYS", "7")
    before = HASHED.copy()
    use()
    assert HASHED["files"] - before["files"] == 1  # the changed file hashed again, found good, the rest stamped

    # A stamp older than the re-verify period: that file hashed again.
    aged = json.loads(stamps.read_text())
    config = next(r for r in aged["files"] if r.endswith("config.json"))
    aged["files"][config][5] -= 8 * 86400
    stamps.write_text(json.dumps(aged))
    before = HASHED.copy()
    use()
    assert HASHED["files"] - before["files"] >= 1


def test_a_step_fetches_the_small_files_and_an_engine_here_adds_the_weights(tiny_model_cache, tmp_path):
    """A step resolves the registered model without its weights (config, tokenizer, processor, manifest: what
    it reads without running the engine); ``here()``, where an engine opens it, adds the weights to the same
    folder once, checked like the rest; later uses hash nothing."""
    from video_assets.core.inference.model_cache import COMPLETE, HASHED, LIGHT, MANIFEST, has_weights

    reg = _registered_tiny(tiny_model_cache, tmp_path)
    files, _ = reg.model_files("captioner", "production", tmp_path / "dl", str(tmp_path / "nodes"))
    folder = Path(files.path)
    on_disk = {p.name for p in (tmp_path / "dl").rglob("*") if p.is_file()}
    assert {"config.json", "tokenizer.json", MANIFEST, LIGHT} <= on_disk
    assert not [n for n in on_disk if n.endswith(".safetensors")] and COMPLETE not in on_disk
    assert not has_weights(folder) and (folder / "config.json").exists()
    stored = sum(p.stat().st_size for p in (tmp_path / "art").rglob("*") if p.is_file())
    fetched = sum(p.stat().st_size for p in (tmp_path / "dl").rglob("*") if p.is_file())
    assert fetched < stored / 2

    assert files.here() == str(folder) and has_weights(folder)
    assert list(folder.rglob("model.safetensors")) and not (tmp_path / "nodes").exists()
    before = HASHED.copy()
    reg.model_files("captioner", "production", tmp_path / "dl", str(tmp_path / "nodes"))
    assert files.here() == str(folder) and HASHED == before


def test_placing_a_light_step_copy_on_a_one_machine_ray_adds_its_weights(tiny_model_cache, tmp_path):
    """``place_on_every_node`` with the step's small-files copy on a one-machine Ray: every node sees the
    folder, so the weights are added to it (not a second copy per node) and engines open it by path."""
    import ray

    from resources.settings import embedded_ray_auth
    from video_assets.core.inference.model_cache import has_weights, place_on_every_node

    reg = _registered_tiny(tiny_model_cache, tmp_path)
    files, _ = reg.model_files("captioner", "production", tmp_path / "dl", str(tmp_path / "nodes"))
    assert not has_weights(files.path)
    with embedded_ray_auth():
        ray.init(num_cpus=1, include_dashboard=False)
        try:
            placed = place_on_every_node(files)
        finally:
            ray.shutdown()
    assert placed.path == files.path and not placed.per_node and has_weights(files.path)
    assert not (tmp_path / "nodes").exists()
