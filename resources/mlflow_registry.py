"""MLflow: model registry (aliases), prompt registry and tracking. A SQLite store under
$DAGSTER_HOME by default, any tracking server by URI.

Everything goes through an explicit ``MlflowClient`` and explicit run ids: no process-global tracking
URI or active run, so two resources with different stores can live in one process.

Errors: only MLflow's "not found" answers mean "no such alias / model / prompt"; any other registry
error fails the caller (a transient error read as "no alias" once let an unevaluated version past the
promotion gate). Every step that uses the resource first checks the store is reachable, with one
short request, instead of the client's retries (over 10 minutes against an unreachable server).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field

from resources.settings import model_reverify_after_s
from video_assets.core.inference.model_cache import MANIFEST, ModelFiles, download_once, manifest_bytes

PREFLIGHT_TIMEOUT_S = 5.0


class MlflowUnavailable(RuntimeError):
    """The tracking/registry store cannot be reached (checked before a step does any work)."""


class RegistryError(RuntimeError):
    """A registry call failed for a reason other than "not found": the step must fail, not guess."""


def is_not_found(exc: Exception) -> bool:
    """MLflow's answer for a missing model/prompt (RESOURCE_DOES_NOT_EXIST) or a missing alias (which
    the SQL and file stores report as INVALID_PARAMETER_VALUE "... alias X not found.", also over REST)."""
    code = getattr(exc, "error_code", None)
    if code == "RESOURCE_DOES_NOT_EXIST":
        return True
    message = str(getattr(exc, "message", exc)).lower()
    return code == "INVALID_PARAMETER_VALUE" and "alias" in message and "not found" in message


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    version: str
    alias: str
    source: str
    created: bool  # False when an existing version already had this source

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{self.alias}"


@dataclass(frozen=True)
class RegisteredPrompt:
    name: str
    version: int
    alias: str
    template: str
    created: bool

    @property
    def uri(self) -> str:
        return f"prompts:/{self.name}@{self.alias}"


FILES_TAG = "files_sha256"  # a model version's tag: sha256 of its logged SHA256SUMS.json


class MlflowRegistry(ConfigurableResource):
    tracking_uri: str = Field(description="MLflow tracking/registry URI (sqlite:///..., http://...)")
    artifact_root: str | None = Field(
        default=None, description="Artifact location for experiments this product creates (local path or bucket)"
    )

    ui_url: str = Field(default="http://127.0.0.1:5000", description="Base URL of the MLflow UI (run links)")
    preflight_timeout_s: float = Field(
        default=PREFLIGHT_TIMEOUT_S, gt=0, description="How long the reachability check before each step waits"
    )

    def setup_for_execution(self, context: InitResourceContext) -> None:
        # Before the step does any work: an unreachable store fails now, in seconds.
        self.check_reachable()

    def check_reachable(self) -> None:
        """One request to the tracking server's /health (no retries), or a check that a SQLite store's
        folder is writable; raises ``MlflowUnavailable`` naming MLFLOW_TRACKING_URI otherwise."""
        uri = self.tracking_uri
        scheme = uri.partition(":")[0].lower()
        if scheme in ("http", "https"):
            url = uri.rstrip("/") + "/health"
            try:
                with urllib.request.urlopen(url, timeout=self.preflight_timeout_s):
                    return
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # it answered: reachable (auth and paths are the client's business)
                    return
                reason = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:  # refused, unresolvable, timed out (TimeoutError is an OSError)
                reason = str(getattr(exc, "reason", None) or exc) or type(exc).__name__
            raise MlflowUnavailable(
                f"MLflow tracking server {uri} did not answer GET /health within {self.preflight_timeout_s:g} s "
                f"({reason}). Start it, or set MLFLOW_TRACKING_URI to a reachable server (unset, the embedded "
                "SQLite store under DAGSTER_HOME is used)."
            )
        if scheme == "sqlite":
            path = uri.split(":", 1)[1].lstrip("/")
            folder = Path("/" + path if uri.startswith("sqlite:////") else path).parent
            if not folder.is_dir():
                raise MlflowUnavailable(
                    f"the folder of the MLflow SQLite store {uri} does not exist: create it, or set "
                    "MLFLOW_TRACKING_URI to another store."
                )
            self._create_sqlite_store_once(folder / ".mlflow-init.lock")

    def _create_sqlite_store_once(self, lock_path: Path) -> None:
        """Open the SQLite store under an exclusive file lock: steps that first touch a new store at once
        (the register_model job's parallel steps) each ran MLflow's schema migration, and all but one
        failed ("table _alembic_tmp_... already exists"). The first creates it; the others wait, then
        find it made (as ``video-assets init`` does for the Dagster instance's storages)."""
        from filelock import FileLock

        with FileLock(lock_path):  # an OS lock: released if this process dies too
            self.client().search_experiments(max_results=1)

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"

    def experiment_id(self, name: str) -> str:
        client = self.client()
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # An explicit location: without it artifacts land in ./mlruns of whatever the cwd is.
        location = None
        if self.artifact_root:
            location = self.artifact_root.rstrip("/") + f"/{name}"
            # A URI has a scheme: s3://..., but also mlflow-artifacts:/... (a server's proxied store),
            # which has no "://" and was once made into a local folder named "mlflow-artifacts:".
            if not _has_scheme(location):
                Path(location).mkdir(parents=True, exist_ok=True)
                location = Path(location).resolve().as_uri()
        return client.create_experiment(name, artifact_location=location)

    @contextmanager
    def run(self, experiment: str, run_name: str, tags: dict[str, str] | None = None):
        """A run by id (``run.info.run_id``); ended FINISHED, or FAILED when the block raises."""
        client = self.client()
        run = client.create_run(self.experiment_id(experiment), run_name=run_name, tags=tags or {})
        try:
            yield run
        except BaseException:
            client.set_terminated(run.info.run_id, "FAILED")
            raise
        client.set_terminated(run.info.run_id, "FINISHED")

    def log_scores(
        self, run_id: str, params: dict, metrics: dict[str, float], documents: dict[str, dict], files: dict[str, bytes]
    ) -> None:
        """Params, metrics, JSON documents and binary files (e.g. a PNG) of one run."""
        from mlflow.entities import Metric, Param

        client, now = self.client(), int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
            params=[Param(k, str(v)) for k, v in params.items()],
        )
        for name, doc in documents.items():
            client.log_dict(run_id, json.loads(json.dumps(doc)), name)
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in files.items():
                (Path(tmp) / name).write_bytes(data)
                client.log_artifact(run_id, str(Path(tmp) / name))

    # -- models -------------------------------------------------------------------------------
    def find_version(self, name: str, tag: str, value: str):
        # A search: an unknown name is an empty result, so any error is a real one (and is raised).
        versions = self.client().search_model_versions(f"name = '{name}'")
        for v in sorted(versions, key=lambda v: int(v.version)):
            if v.tags.get(tag) == value:
                return v
        return None

    def register_model_folder(
        self,
        folder: Path,
        name: str,
        alias: str,
        source: str,
        fingerprint: str,
        task: str = "image-text-to-text",
        experiment: str = "vlm-models",
        tags: dict[str, str] | None = None,
        set_alias: bool = True,
        flavor: str = "transformers",
    ) -> RegisteredModel:
        """Log ``folder`` (a saved model + processor) in path form and register it; idempotent on ``fingerprint``.
        ``flavor="files"`` logs the folder as it is (models that are not transformers pipelines: a
        CTranslate2 Whisper, a torch checkpoint); it downloads back byte for byte."""
        client = self.client()
        existing = self.find_version(name, "source_fingerprint", fingerprint)
        if existing is not None:
            if set_alias:
                client.set_registered_model_alias(name, alias, existing.version)
            return RegisteredModel(name, str(existing.version), alias, source, created=False)
        import mlflow.transformers

        if not self._model_exists(name):
            client.create_registered_model(name)
        with (
            self.run(experiment, run_name=f"register-{name}", tags={"source": source}) as run,
            tempfile.TemporaryDirectory() as tmp,
            _pipeline_classes_resolved(),
        ):
            if flavor == "files":
                logged = Path(folder)
            else:
                # Path form: MLflow copies the folder; the dict form fails for multimodal processors.
                mlflow.transformers.save_model(transformers_model=str(folder), path=f"{tmp}/model", task=task)
                logged = Path(f"{tmp}/model")
            # Every file's sha256, logged beside the files; its own digest is the version's files_sha256
            # tag: every download and every use of a cached copy is checked against both.
            manifest = manifest_bytes(logged)
            (Path(tmp) / MANIFEST).write_bytes(manifest)
            client.log_artifacts(run.info.run_id, str(logged), "model")
            client.log_artifact(run.info.run_id, str(Path(tmp) / MANIFEST), "model")
            source_uri = f"{run.info.artifact_uri.rstrip('/')}/model"
        version = client.create_model_version(
            name,
            source_uri,
            run_id=run.info.run_id,
            tags={
                "source": source,
                "source_fingerprint": fingerprint,
                FILES_TAG: hashlib.sha256(manifest).hexdigest(),
                **(tags or {}),
            },
        )
        if set_alias:
            client.set_registered_model_alias(name, alias, version.version)
        return RegisteredModel(name, str(version.version), alias, source, created=True)

    def _model_exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client().get_registered_model(name)
            return True
        except MlflowException as exc:
            if is_not_found(exc):
                return False
            raise self._registry_error(f"model {name}", exc) from exc

    def _registry_error(self, what: str, exc: Exception) -> RegistryError:
        return RegistryError(
            f"MLflow registry error on {what} at {self.tracking_uri}: {exc}. Not read as 'not found'; "
            "check the store (MLFLOW_TRACKING_URI) and rerun."
        )

    def resolve_alias(self, name: str, alias: str):
        return self.client().get_model_version_by_alias(name, alias)

    # -- aliases (models and prompts alike: kind is "model" or "prompt") ----------------------------
    def alias_version(self, kind: str, name: str, alias: str) -> str | None:
        """The version behind ``alias`` as a string, or None when the alias (or the name) does not exist."""
        from mlflow.exceptions import MlflowException

        client = self.client()
        try:
            v = (
                client.get_model_version_by_alias(name, alias)
                if kind == "model"
                else client.get_prompt_version_by_alias(name, alias)
            )
        except MlflowException as exc:
            if is_not_found(exc):
                return None
            raise self._registry_error(f"{kind} alias {name}@{alias}", exc) from exc
        return str(v.version)

    def set_alias(self, kind: str, name: str, alias: str, version: str | int) -> None:
        client = self.client()
        if kind == "model":
            client.set_registered_model_alias(name, alias, str(version))
        else:
            client.set_prompt_alias(name, alias, int(version))

    def delete_alias(self, kind: str, name: str, alias: str) -> None:
        if self.alias_version(kind, name, alias) is None:
            return
        client = self.client()
        if kind == "model":
            client.delete_registered_model_alias(name, alias)
        else:
            client.delete_prompt_alias(name, alias)

    def place_new_version(
        self,
        kind: str,
        name: str,
        version: str | int,
        production: str = "production",
        challenger: str = "challenger",
        skip_gate: bool = False,
    ) -> str:
        """Where a (possibly new) version goes: behind ``production`` when there is none yet (or
        ``skip_gate``), nowhere new when it already is production, else behind ``challenger`` for the
        promotion job to evaluate. Returns the alias it is behind."""
        current = self.alias_version(kind, name, production)
        if current is None or skip_gate:
            self.set_alias(kind, name, production, version)
            if self.alias_version(kind, name, challenger) == str(version):
                self.delete_alias(kind, name, challenger)
            return production
        if current == str(version):
            return production
        self.set_alias(kind, name, challenger, version)
        return challenger

    def download_model(self, name: str, alias: str, dest: Path) -> tuple[Path, str]:
        """Download ``models:/name@alias`` to ``dest`` (cached per version), weights too; returns the model
        folder and version."""
        files, version = self.model_files(name, alias, dest, node_cache_dir="", weights=True)
        return Path(files.path), version

    def model_files(
        self, name: str, alias: str, dest: Path, node_cache_dir: str, weights: bool = False
    ) -> tuple[ModelFiles, str]:
        """``download_model`` plus what another node needs to fetch the same version into its
        ``node_cache_dir``: one alias lookup, so the folder and the artifact URI are one version."""
        return self.version_files(self.resolve_alias(name, alias), dest, node_cache_dir, weights)

    def version_files(self, version, dest: Path, node_cache_dir: str, weights: bool = False) -> tuple[ModelFiles, str]:
        """One registered version (an MLflow ModelVersion) fetched under ``dest`` and checked against the
        digests it was registered with; what other nodes need to fetch it too. Only its small files unless
        ``weights``: a step resolves the model without its weights, and whatever runs an engine on this
        machine gets them through ``ModelFiles.here()`` (so a step whose engines run elsewhere never does)."""
        sha = (version.tags or {}).get(FILES_TAG)
        # Keyed by the artifact too: "v1" of a registry made anew (or of another store sharing the models
        # cache) is another model, not the cached one.
        folder = f"{version.name}-v{version.version}-{hashlib.sha256(version.source.encode()).hexdigest()[:12]}"
        reverify = model_reverify_after_s()
        path = download_once(version.source, Path(dest) / folder, self.tracking_uri, sha, weights, reverify)
        files = ModelFiles(str(path), version.source, node_cache_dir, self.tracking_uri, sha, reverify)
        return files, str(version.version)

    def artifact_uri(self, name: str, alias: str) -> str:
        """Where the version behind ``alias`` is stored: what a Ray actor on another node downloads."""
        return self.resolve_alias(name, alias).source

    # -- prompts ------------------------------------------------------------------------------
    def register_prompt(
        self, name: str, template: str, alias: str | None, commit_message: str = ""
    ) -> RegisteredPrompt:
        """A new prompt version only when the text changed; ``alias`` (unless None) then points at it."""
        from mlflow.exceptions import MlflowException

        client = self.client()
        try:
            latest = client.load_prompt(f"prompts:/{name}@latest")
        except MlflowException as exc:
            if not is_not_found(exc):  # else a transient error would register a duplicate version
                raise self._registry_error(f"prompt {name}", exc) from exc
            latest = None
        if latest is not None and latest.template == template:
            version, created = int(latest.version), False
        else:
            pv = client.register_prompt(name=name, template=template, commit_message=commit_message or None)
            version, created = int(pv.version), True
        if alias is not None:
            client.set_prompt_alias(name, alias, version)
        return RegisteredPrompt(name, version, alias or "", template, created)

    def load_prompt(self, name: str, alias: str) -> RegisteredPrompt:
        pv = self.client().load_prompt(f"prompts:/{name}@{alias}")
        return RegisteredPrompt(name, int(pv.version), alias, pv.template, created=False)


def _has_scheme(location: str) -> bool:
    """``s3://b/p``, ``file:///p``, ``mlflow-artifacts:/p`` yes; ``/p``, ``rel/p``, ``C:\\p`` no."""
    scheme, sep, _ = location.partition(":")
    return bool(sep) and len(scheme) > 1 and scheme.replace("-", "").replace("+", "").replace(".", "").isalnum()


@contextmanager
def _pipeline_classes_resolved():
    """transformers 5 lists pipeline classes in its task registry as dotted strings (lazy imports);
    MLflow's transformers flavor (3.17/3.18) reads ``impl.__name__`` of that entry while saving in path
    form and fails with "'str' object has no attribute '__name__'". While saving, resolve the string
    to the class. Applied only when the installed transformers has the string form, so it is a no-op
    once either side changes."""
    import importlib

    from transformers import pipelines

    sample = next(iter(pipelines.SUPPORTED_TASKS.values()), {}).get("impl")
    if not isinstance(sample, str):
        yield
        return
    original = pipelines.check_task

    def check_task(task):
        normalized, meta, options = original(task)
        impl = meta.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return normalized, meta, options

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = original
