"""A model on the node that runs it: each Ray actor (or the Dagster step) resolves the registered
model to a folder on its own machine, downloading the artifact once per node into a node-local cache.
A file lock makes two actors on one node wait for one download instead of both writing the folder.
Each file is hashed once: later uses compare a stamp (``STAMPS``) and hash only what changed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections import Counter
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
# In the fetched folder, beside its markers: {path relative to the manifest: [size, mtime_ns, ctime_ns, inode,
# sha256, verified at (s)]} of each file hashed and found as registered. A file whose stat still matches is
# not read again; ctime (which no user call can set) also catches a change that restored size and mtime.
STAMPS = ".verified.json"
# A stamp is only trusted for a file last written this long before it was taken: a write in the same clock
# tick as the recorded one would leave mtime unchanged (coarse file-system clocks; git's "racy clean").
RACY_NS = 2_000_000_000
# A stamp this old is hashed again in full (the settings' VIDEO_MODEL_REVERIFY_DAYS; 0: every use).
REVERIFY_AFTER_S = 7 * 86400.0
# Files and bytes this process has hashed: what a stamp saves is visible (tests, the benchmark).
HASHED: Counter = Counter()


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
            HASHED["bytes"] += len(chunk)
    HASHED["files"] += 1
    return h.hexdigest()


def _ours(name: str) -> bool:
    """A file this product writes in a model folder (manifest, markers, stamps), not one of the model's."""
    return name in (MANIFEST, COMPLETE, LIGHT) or name.startswith(STAMPS)


def _model_files(folder: Path) -> dict[str, Path]:
    """A model folder's files by their path relative to it (the manifest, markers and stamps aside)."""
    files = (p for p in Path(folder).rglob("*") if p.is_file() and not _ours(p.name))
    return {p.relative_to(folder).as_posix(): p for p in sorted(files)}


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _read_stamps(folder: Path) -> dict[str, list]:
    try:
        return dict(json.loads((folder / STAMPS).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # none yet, or unreadable: every file is hashed


def _write_stamps(folder: Path, stamps: dict[str, list]) -> None:
    """Replaced whole (concurrent verifiers never see half a file); best effort: a read-only cache only
    loses the saving (every use hashes, as before stamps)."""
    tmp = folder / f"{STAMPS}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        tmp.write_text(json.dumps({"files": stamps}, sort_keys=True))
        os.replace(tmp, folder / STAMPS)
    except OSError:
        tmp.unlink(missing_ok=True)


def _stamp(path: Path, digest: str, taken_ns: int, st: os.stat_result | None = None) -> list | None:
    """The stamp of ``path`` (hashed to ``digest`` from the stat ``st``, taken at ``taken_ns``), or None when its
    last write is too recent to trust one (``RACY_NS``)."""
    st = st or path.stat()
    if taken_ns - st.st_mtime_ns < RACY_NS:
        return None
    return [*_stat_key(st), digest, taken_ns / 1e9]


def _stamped(entry: list | None, st: os.stat_result, want: str, reverify_after_s: float | None) -> bool:
    """Whether ``entry`` vouches for a file with stat ``st`` holding ``want``: same stat, same digest, fresh."""
    if not entry or len(entry) != 6 or entry[:4] != _stat_key(st) or entry[4] != want:
        return False
    if reverify_after_s is None:
        return True
    return reverify_after_s > 0 and time.time() - float(entry[5]) < reverify_after_s


def manifest_bytes(folder: Path) -> bytes:
    """The manifest of ``folder``: every file's sha256, by its path relative to the folder."""
    digests = {rel: file_sha256(p) for rel, p in _model_files(folder).items()}
    return json.dumps(digests, indent=1, sort_keys=True).encode()


def is_weight(rel: str) -> bool:
    """Whether a model file is weights (what only a node running the engine needs)."""
    return rel.lower().endswith(WEIGHT_SUFFIXES)


def verify_files(
    folder: Path,
    files_sha256: str | None,
    what: str = "",
    light: bool = False,
    reverify_after_s: float | None = REVERIFY_AFTER_S,
    stamps: bool = True,
) -> dict[str, str]:
    """Check a downloaded model against its registered manifest (``files_sha256``: the manifest's own
    sha256, from the registry): every listed file present with its digest, and no other file (``light``:
    a copy without its weights, ``fetch_on_node``, need not hold the weight files). None (a version
    registered before manifests) checks nothing. Raises ``ModelFilesChanged`` naming the file.

    ``stamps``: a file whose stamp (``STAMPS``) still matches its stat and digest is not read again, and
    the files hashed are stamped; ``reverify_after_s``: a stamp older than this is hashed again (0: every
    file hashed, the full re-verify; None: never by age). Returns the digests checked, by relative path."""
    if files_sha256 is None:
        return {}
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
    old = _read_stamps(folder) if stamps else {}
    new: dict[str, list] = {}
    checked: dict[str, str] = {}
    for rel, want in expected.items():
        path = root / rel
        if light and is_weight(rel) and not path.exists():
            continue
        taken = time.time_ns()
        st = path.stat() if path.is_file() else None  # before reading: a write during the hash changes it
        if st is not None and _stamped(old.get(rel), st, want, reverify_after_s):
            new[rel], checked[rel] = old[rel], want
            continue
        got = file_sha256(path) if st is not None else "missing"
        if got != want:
            raise ModelFilesChanged(
                f"{path}: sha256 {got}, registered {want}: the model file was changed; "
                f"delete {folder} to download it again, or register the model anew"
            )
        checked[rel] = want
        if (entry := _stamp(path, want, taken, st)) is not None:
            new[rel] = entry
    if stamps and new != old:
        _write_stamps(folder, new)
    return checked


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
    artifact_uri: str,
    target: Path,
    tracking_uri: str | None = None,
    files_sha256: str | None = None,
    weights: bool = True,
    reverify_after_s: float | None = REVERIFY_AFTER_S,
) -> Path:
    """``artifact_uri`` downloaded into ``target`` exactly once per machine, whoever asks first (``weights``
    False: only its small files, ``LIGHT``; ``local_model`` adds the weights when an engine opens it);
    returns the model folder inside it. Checked against ``files_sha256`` (``verify_files``) after the
    download and on every later use of the cached copy (a stamp check; a file that changed is hashed)."""
    return _fetch_once(artifact_uri, Path(target), tracking_uri, files_sha256, weights, reverify_after_s)


def _fetched(target: Path, weights: bool) -> bool:
    """Whether ``target`` holds the model (``weights``), or at least its small files."""
    return (target / COMPLETE).exists() or (not weights and (target / LIGHT).exists())


def _fetch_once(
    artifact_uri: str,
    target: Path,
    tracking_uri: str | None,
    files_sha256: str | None,
    weights: bool,
    reverify_after_s: float | None = REVERIFY_AFTER_S,
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
    verify_files(target, files_sha256, artifact_uri, not (target / COMPLETE).exists(), reverify_after_s)
    return model_dir(target)


def cache_root(model_path: Path) -> Path | None:
    """The folder this product fetched ``model_path`` into (the one with its ``COMPLETE`` or ``LIGHT``
    marker: ``model_dir`` is at most a few levels below it), or None for a folder it did not fetch."""
    for folder in [model_path, *list(model_path.parents)[:4]]:
        if (folder / COMPLETE).exists() or (folder / LIGHT).exists():
            return folder
    return None


def has_weights(model_path: str | Path) -> bool:
    """Whether ``model_path`` can be opened by an engine here: a folder of the model (config.json) that is
    not a fetch of its small files only."""
    path = Path(model_path)
    if not (path / "config.json").exists():
        return False
    root = cache_root(path)
    return root is None or (root / COMPLETE).exists()


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
    reverify_after_s: float | None = REVERIFY_AFTER_S,
) -> str:
    """``model_path`` when this machine has it (the step's own download, or a shared filesystem): checked
    against ``files_sha256`` (a stamp check), its weights added in place when the step fetched only its
    small files; else the artifact downloaded into this node's ``cache_dir``."""
    root = cache_root(Path(model_path)) if (Path(model_path) / "config.json").exists() else None
    if root is not None and artifact_uri:
        return str(_fetch_once(artifact_uri, root, tracking_uri, files_sha256, True, reverify_after_s))
    if has_weights(model_path):
        return model_path
    if not artifact_uri:
        raise FileNotFoundError(f"model folder {model_path} is not on this node and no artifact URI was given")
    target = node_cache_path(artifact_uri, cache_dir)
    return str(download_once(artifact_uri, target, tracking_uri, files_sha256, True, reverify_after_s))


@dataclass(frozen=True)
class ModelFiles:
    """A registered model's files: the step's own download (``path``: its small files at least, enough to
    resolve the model; ``here()`` for its weights) and the artifact any other node downloads into its
    ``cache_dir``. Plain data, so it ships to Ray workers."""

    path: str
    artifact_uri: str | None = None
    cache_dir: str = ""
    tracking_uri: str | None = None
    files_sha256: str | None = None  # the registered manifest's sha256 (``verify_files``)
    reverify_after_s: float | None = REVERIFY_AFTER_S  # a stamp older than this is hashed again (0: every use)

    def here(self) -> str:
        """A folder with the whole model on the machine running this (downloading it, or the weights the
        step did not fetch, once if needed). ``path`` may hold only the small files: open weights from here."""
        return local_model(
            self.path, self.artifact_uri, self.cache_dir, self.tracking_uri, self.files_sha256, self.reverify_after_s
        )


@dataclass
class Placement:
    """Where an engine that opens the model by path on any node can find it."""

    path: str  # the same on every node
    # True: the path is a node-local cache each stage's actor fills on its own node as it starts
    # (``fetch_in_stages``), so a node that joins later is covered; False: the step's folder, on every node.
    per_node: bool = False
    nodes: dict[str, str] = field(default_factory=dict)  # Ray node id -> "present" (shared mode)


def _model_state(path: str) -> str:
    """What the node running this holds at ``path``: "whole", "light" (only its small files) or "" (no model)."""
    if not (Path(path) / "config.json").exists():
        return ""
    return "whole" if has_weights(path) else "light"


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
    return str(
        _fetch_once(files.artifact_uri, target, files.tracking_uri, files.files_sha256, weights, files.reverify_after_s)
    )


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
    _settle(partial)
    # A changed artifact never lands. Checked without stamps: moving the files changes their ctime.
    try:
        digests = verify_files(partial, files_sha256, uri, light=names is not None, stamps=False)
    except ModelFilesChanged:
        shutil.rmtree(partial, ignore_errors=True)  # refused: not kept on disk either
        raise
    _move_into(partial, target)
    _stamp_fetched(target, digests)


def _settle(folder: Path) -> None:
    """Files just written here, dated back past ``RACY_NS`` (nobody else writes this private folder): their
    stamps are trusted at once, and any later write, even within the same clock tick, changes their mtime."""
    now = time.time_ns()
    for path in folder.rglob("*"):
        if path.is_file() and now - (st := path.stat()).st_mtime_ns < RACY_NS:
            os.utime(path, ns=(st.st_atime_ns, now - RACY_NS))


def _stamp_fetched(target: Path, digests: dict[str, str]) -> None:
    """Stamps for the files of a fresh download, hashed before they moved in: their first use hashes nothing."""
    if not digests:
        return
    [manifest] = target.rglob(MANIFEST)
    root, taken = manifest.parent, time.time_ns()
    stamps = _read_stamps(target)
    for rel, digest in digests.items():
        if (entry := _stamp(root / rel, digest, taken)) is not None:
            stamps[rel] = entry
    _write_stamps(target, stamps)


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
    task = ray.remote(num_cpus=0, max_retries=2)(_model_state)

    def states() -> list[str]:
        return ray.get(
            [
                task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(files.path)
                for node in nodes
            ]
        )

    found = states()
    if all(found) and "light" in found and files.artifact_uri:
        files.here()  # every node sees the step's light copy (one machine, or shared): the weights added to it
        found = states()
    if all(s == "whole" for s in found):
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
