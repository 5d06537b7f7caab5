"""A model on the node that runs it: each Ray actor (or the Dagster step) resolves the registered
model to a folder on its own machine, downloading the artifact once per node into a node-local cache.
A file lock makes two actors on one node wait for one download instead of both writing the folder."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

COMPLETE = ".complete"  # written last: a folder without it is a download that did not finish
# Logged with every registered model: {relative path: sha256} of each file. The registry's version tag
# ``files_sha256`` is the sha256 of this file, so the list itself cannot be swapped with the files.
MANIFEST = "SHA256SUMS.json"
# Written instead of COMPLETE by a fetch without weights (``fetch_on_node(weights=False)``): a stage that
# only reads the config, tokenizer and processor files; an engine on the node fetches the rest.
LIGHT = ".light"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_READ = 1 << 20


class ModelFilesChanged(RuntimeError):
    """A model file differs from what was registered; the message names the file and both digests."""


class PinnedDigestMismatch(ValueError):
    """A packaged model's file is not the one pinned in the source; the message names the file."""


def verify_pinned(folder: Path, pinned: dict[str, str], own: frozenset[str] = frozenset(), what: str = "") -> None:
    """Check a model folder built from installed packages against the digests pinned in the source: every
    pinned file present with its sha256, and no file that is neither pinned nor in ``own`` (the files this
    product writes beside them). Raises ``PinnedDigestMismatch`` naming the file."""
    files = _model_files(Path(folder))
    for rel, want in sorted(pinned.items()):
        got = file_sha256(files[rel]) if rel in files else "missing"
        if got != want:
            raise PinnedDigestMismatch(
                f"{what} {Path(folder) / rel}: sha256 {got}, pinned {want}: the installed package's file is "
                "not the published one; reinstall it from the lock (make install), refusing to register it"
            )
    if extra := sorted(set(files) - set(pinned) - own):
        raise PinnedDigestMismatch(f"{what} {Path(folder) / extra[0]}: not a file of the packaged model")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def _model_files(folder: Path) -> dict[str, Path]:
    """A model folder's files by their path relative to it (the manifest and the download marker aside)."""
    files = (p for p in Path(folder).rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE, LIGHT))
    return {p.relative_to(folder).as_posix(): p for p in sorted(files)}


def manifest_bytes(folder: Path) -> bytes:
    """The manifest of ``folder``: every file's sha256, by its path relative to the folder."""
    digests = {rel: file_sha256(p) for rel, p in _model_files(folder).items()}
    return json.dumps(digests, indent=1, sort_keys=True).encode()


def is_weight(rel: str) -> bool:
    """Whether a model file is weights (what only a node running the engine needs)."""
    return rel.lower().endswith(WEIGHT_SUFFIXES)


def verify_files(folder: Path, files_sha256: str | None, what: str = "", light: bool = False) -> None:
    """Check a downloaded model against its registered manifest (``files_sha256``: the manifest's own
    sha256, from the registry): every listed file present with its digest, and no other file (``light``:
    a copy without its weights, ``fetch_on_node``, need not hold the weight files). None (a version
    registered before manifests) checks nothing. Raises ``ModelFilesChanged`` naming the file."""
    if files_sha256 is None:
        return
    folder = Path(folder)
    found = list(folder.rglob(MANIFEST))
    if len(found) != 1:
        raise ModelFilesChanged(f"{what or folder}: {MANIFEST} missing; delete {folder} to download it again")
    listed = found[0].read_bytes()
    if (got := hashlib.sha256(listed).hexdigest()) != files_sha256:
        raise ModelFilesChanged(f"{found[0]}: sha256 {got}, registered {files_sha256}: the file list was changed")
    root, expected = found[0].parent, json.loads(listed)
    extra = [rel for rel in _model_files(root) if rel not in expected]
    if extra:
        raise ModelFilesChanged(f"{root / extra[0]}: not a file of the registered model ({len(extra)} such files)")
    for rel, want in expected.items():
        path = root / rel
        if light and is_weight(rel) and not path.exists():
            continue
        got = file_sha256(path) if path.is_file() else "missing"
        if got != want:
            raise ModelFilesChanged(
                f"{path}: sha256 {got}, registered {want}: the model file was changed; "
                f"delete {folder} to download it again, or register the model anew"
            )


def model_dir(root: Path) -> Path:
    """The folder holding config.json inside a downloaded MLflow transformers model."""
    for candidate in [root / "model", root]:
        if (candidate / "config.json").exists():
            return candidate
    hits = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not hits:
        raise FileNotFoundError(f"no config.json under downloaded model {root}")
    return hits[0].parent


def download_once(
    artifact_uri: str, target: Path, tracking_uri: str | None = None, files_sha256: str | None = None
) -> Path:
    """``artifact_uri`` downloaded into ``target`` exactly once per machine, whoever asks first;
    returns the model folder inside it. Checked against ``files_sha256`` (``verify_files``) after the
    download and on every later use of the cached copy."""
    return _fetch_once(artifact_uri, Path(target), tracking_uri, files_sha256, weights=True)


def _fetched(target: Path, weights: bool) -> bool:
    """Whether ``target`` holds the model (``weights``), or at least its small files."""
    return (target / COMPLETE).exists() or (not weights and (target / LIGHT).exists())


def _fetch_once(
    artifact_uri: str, target: Path, tracking_uri: str | None, files_sha256: str | None, weights: bool
) -> Path:
    """The artifact in ``target``, fetched there once per machine, whoever asks first (a file lock): all of it
    (``weights``), else only its small files (``fetch_on_node``). A fresh download is checked before it moves
    in; a copy already there is checked as it is used. Returns the model folder inside it."""
    if not _fetched(target, weights):
        from filelock import FileLock

        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(target.parent / f".{target.name}.lock"):  # an OS lock: released if this process dies
            if not _fetched(target, weights):
                names = None if weights else _light_files(artifact_uri, tracking_uri)
                _fetch(artifact_uri, tracking_uri, files_sha256, target, names)
                (target / (COMPLETE if weights else LIGHT)).touch()
                return model_dir(target)
    verify_files(target, files_sha256, artifact_uri, light=not (target / COMPLETE).exists())
    return model_dir(target)


class ModelStoreUnreachable(RuntimeError):
    """This node cannot read the registered model: the message names the setting to change."""


def machine_local(uri: str | None) -> bool:
    """Whether ``uri`` names something only the machine that wrote it can read: a plain path, ``file:`` or
    ``sqlite:`` (not ``s3://``, ``http://``, ``mlflow-artifacts:``, ``models:``, ...). None: the embedded default."""
    if not uri:
        return True
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]+):", uri)
    return scheme is None or scheme[1].lower() in ("file", "sqlite")


def store_error(artifact_uri: str, tracking_uri: str | None, exc: Exception) -> Exception:
    """The error of a failed model download on a node: a clear one when the registry is the embedded store
    (a SQLite file and an artifact folder on the Dagster machine), which a worker on another machine cannot
    read; else the download's own error."""
    if not (machine_local(artifact_uri) or machine_local(tracking_uri)):
        return exc
    import socket

    return ModelStoreUnreachable(
        f"node {socket.gethostname()} cannot read the registered model {artifact_uri} "
        f"({exc.__class__.__name__}: {exc}): the model registry is a store on the Dagster machine "
        f"(MLFLOW_TRACKING_URI={tracking_uri or 'the embedded SQLite default'}), which other machines cannot "
        "read. On a cluster set MLFLOW_TRACKING_URI to an MLflow server whose artifacts every node can reach "
        "(docs/scale-out.md, section (c)), or give the nodes a shared VLM_CACHE_DIR"
    )


def node_cache_path(artifact_uri: str, cache_dir: str) -> Path:
    """Where a node keeps its own download of ``artifact_uri``: the same path on every node."""
    return Path(cache_dir) / "node-models" / hashlib.sha256(artifact_uri.encode()).hexdigest()[:16]


def local_model(
    model_path: str,
    artifact_uri: str | None,
    cache_dir: str,
    tracking_uri: str | None = None,
    files_sha256: str | None = None,
) -> str:
    """``model_path`` when this machine has it (the step's own download, or a shared filesystem);
    else the artifact downloaded into this node's ``cache_dir`` (checked against ``files_sha256``)."""
    if (Path(model_path) / "config.json").exists():
        return model_path
    if not artifact_uri:
        raise FileNotFoundError(f"model folder {model_path} is not on this node and no artifact URI was given")
    return str(download_once(artifact_uri, node_cache_path(artifact_uri, cache_dir), tracking_uri, files_sha256))


@dataclass(frozen=True)
class ModelFiles:
    """A registered model's files: the step's own download (``path``) and the artifact any other node
    downloads into its ``cache_dir``. Plain data, so it ships to Ray workers."""

    path: str
    artifact_uri: str | None = None
    cache_dir: str = ""
    tracking_uri: str | None = None
    files_sha256: str | None = None  # the registered manifest's sha256 (``verify_files``)

    def here(self) -> str:
        """A folder with the model on the machine running this (downloading it once if needed)."""
        return local_model(self.path, self.artifact_uri, self.cache_dir, self.tracking_uri, self.files_sha256)


@dataclass
class Placement:
    """Where an engine that opens the model by path on any node can find it."""

    path: str  # the same on every node
    # True: the path is a node-local cache each stage's actor fills on its own node as it starts
    # (``fetch_in_stages``), so a node that joins later is covered; False: the step's folder, on every node.
    per_node: bool = False
    nodes: dict[str, str] = field(default_factory=dict)  # Ray node id -> "present" (shared mode)


def _has_model(path: str) -> bool:
    return (Path(path) / "config.json").exists()


def _move_into(partial: Path, target: Path) -> None:
    """Every file of ``partial`` moved into ``target`` one by one (each move atomic), so a stage on this node
    reading the light copy's files never sees them vanish while the weights arrive."""
    for src in sorted(p for p in partial.rglob("*") if p.is_file()):
        dst = target / src.relative_to(partial)
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.replace(dst)
    shutil.rmtree(partial, ignore_errors=True)


def _list_files(artifact_uri: str, tracking_uri: str | None, prefix: str = "") -> list[str]:
    import mlflow.artifacts

    found = []
    uri = artifact_uri.rstrip("/") + (f"/{prefix}" if prefix else "")
    for info in mlflow.artifacts.list_artifacts(artifact_uri=uri, tracking_uri=tracking_uri):
        rel = f"{prefix}/{Path(info.path).name}" if prefix else Path(info.path).name
        found += _list_files(artifact_uri, tracking_uri, rel) if info.is_dir else [rel]
    return found


def _light_files(artifact_uri: str, tracking_uri: str | None) -> list[str]:
    """The artifact's files but its weights (what Ray's CPU stages open)."""
    try:
        return [rel for rel in _list_files(artifact_uri, tracking_uri) if not is_weight(rel)]
    except Exception as exc:
        raise store_error(artifact_uri, tracking_uri, exc) from exc


def fetch_on_node(files: ModelFiles, weights: bool = True) -> str:
    """The registered model in this node's cache (``node_cache_path``), fetched here if it is not: all of
    it for an engine (``weights``), else only its small files (config, tokenizer, processor: what Ray's
    CPU stages open), so weights land only on nodes that run an engine. One fetch per node and kind under
    the file lock; every file checked against the registered manifest. Returns the model folder."""
    if not files.artifact_uri:
        raise FileNotFoundError(f"model folder {files.path} is not on this node and no artifact URI was given")
    target = node_cache_path(files.artifact_uri, files.cache_dir)
    return str(_fetch_once(files.artifact_uri, target, files.tracking_uri, files.files_sha256, weights))


def _fetch(uri: str, tracking_uri: str | None, files_sha256: str | None, target: Path, names: list[str] | None) -> None:
    """The artifact (``names``: only these files of it) downloaded and checked beside ``target``, then moved in
    file by file (a light copy already there is completed, never removed under a stage reading it)."""
    import mlflow.artifacts

    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if names is None:
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(partial), tracking_uri=tracking_uri)
        base = uri.rstrip("/").rsplit("/", 1)[-1]  # where download_artifacts puts a whole artifact
        for rel in names or []:
            dst = partial / base / Path(rel).parent
            dst.mkdir(parents=True, exist_ok=True)
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"{uri.rstrip('/')}/{rel}", dst_path=str(dst), tracking_uri=tracking_uri
            )
    except Exception as exc:
        raise store_error(uri, tracking_uri, exc) from exc
    verify_files(partial, files_sha256, uri, light=names is not None)  # a changed artifact never lands
    _move_into(partial, target)


def place_on_every_node(files: ModelFiles) -> Placement:
    """One model path valid on every Ray node, for engines Ray places by itself that open the model by path
    wherever they land (vLLM, and Ray Data LLM's chat-template and multimodal stages).

    The step's own folder when every alive node sees it (one machine, or a shared filesystem). Else the
    node-local cache path (``node_cache_path``, the same on every node): its small files are fetched here
    to learn the layout, and each stage's actor fetches what it needs on its own node as it starts
    (``fetch_in_stages``), so a node that joins the cluster after the step started is covered, and only
    nodes running an engine get the weights."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    task = ray.remote(num_cpus=0, max_retries=2)(_has_model)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(files.path)
        for node in nodes
    ]
    if all(ray.get(refs)):
        return Placement(files.path, False, {node: "present" for node in nodes})
    if not files.artifact_uri:
        raise FileNotFoundError(
            f"model folder {files.path} is not on every Ray node and no artifact URI was given to download it there"
        )
    return Placement(fetch_on_node(files, weights=False), True)


def fetch_in_stages(stages: dict, files: ModelFiles, engine_stages: tuple[str, ...]) -> None:
    """Each stage's actor class (Ray Data LLM's stateful stage UDFs, by stage name) made to fetch the model
    on its node before it opens it: all of it for ``engine_stages``, the small files for the others."""
    for name, stage in list(stages.items()):
        # A copy with the new class: the stage model's own validation of ``fn`` refuses a class assigned to it.
        stages[name] = stage.model_copy(update={"fn": on_node_model(stage.fn, files, weights=name in engine_stages)})


def on_node_model(udf: type, files: ModelFiles, weights: bool) -> type:
    """``udf`` (an actor class that opens the model by path in its constructor) preceded by
    ``fetch_on_node`` on whatever node Ray starts it. Keeps the class's name: Ray names operators and
    actors after it."""

    class OnNodeModel(udf):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            fetch_on_node(files, weights)
            super().__init__(*args, **kwargs)

    OnNodeModel.__name__ = OnNodeModel.__qualname__ = udf.__name__
    return OnNodeModel
