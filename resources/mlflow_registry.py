"""MLflow: model registry (aliases), prompt registry and tracking. A SQLite store under
$DAGSTER_HOME by default, any tracking server by URI."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dagster import ConfigurableResource
from pydantic import Field

# MLflow reads these at import; keep it quiet and offline-friendly.
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


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


class MlflowRegistry(ConfigurableResource):
    tracking_uri: str = Field(description="MLflow tracking/registry URI (sqlite:///..., http://...)")
    artifact_root: str | None = Field(
        default=None, description="Artifact location for experiments this product creates (local path or bucket)"
    )

    def _mlflow(self):
        import mlflow

        mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_registry_uri(self.tracking_uri)
        return mlflow

    def client(self):
        from mlflow import MlflowClient

        self._mlflow()
        return MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def experiment_id(self, name: str) -> str:
        mlflow = self._mlflow()
        found = mlflow.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        # An explicit location: without it artifacts land in ./mlruns of whatever the cwd is.
        location = None
        if self.artifact_root:
            location = self.artifact_root.rstrip("/") + f"/{name}"
            if "://" not in location:
                Path(location).mkdir(parents=True, exist_ok=True)
                location = Path(location).resolve().as_uri()
        return mlflow.create_experiment(name, artifact_location=location)

    @contextmanager
    def run(self, experiment: str, run_name: str, tags: dict[str, str] | None = None) -> Iterator:
        mlflow = self._mlflow()
        with mlflow.start_run(experiment_id=self.experiment_id(experiment), run_name=run_name, tags=tags) as run:
            yield run

    # -- models -------------------------------------------------------------------------------
    def find_version(self, name: str, tag: str, value: str):
        client = self.client()
        try:
            versions = client.search_model_versions(f"name = '{name}'")
        except Exception:  # registered model does not exist yet
            return None
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
    ) -> RegisteredModel:
        """Log ``folder`` (a saved model + processor) in path form and register it; idempotent on ``fingerprint``."""
        client = self.client()
        existing = self.find_version(name, "source_fingerprint", fingerprint)
        if existing is not None:
            if set_alias:
                client.set_registered_model_alias(name, alias, existing.version)
            return RegisteredModel(name, str(existing.version), alias, source, created=False)
        mlflow = self._mlflow()
        import mlflow.transformers

        with self.run(experiment, run_name=f"register-{name}", tags={"source": source}), _pipeline_classes_resolved():
            # Path form: MLflow copies the folder; the dict form fails for multimodal processors.
            info = mlflow.transformers.log_model(
                transformers_model=str(folder), name="model", task=task, tags={"source": source}
            )
        version = mlflow.register_model(info.model_uri, name, tags={"source": source, "source_fingerprint": fingerprint, **(tags or {})})
        if set_alias:
            client.set_registered_model_alias(name, alias, version.version)
        return RegisteredModel(name, str(version.version), alias, source, created=True)

    def resolve_alias(self, name: str, alias: str):
        return self.client().get_model_version_by_alias(name, alias)

    # -- aliases (models and prompts alike: kind is "model" or "prompt") ----------------------------
    def alias_version(self, kind: str, name: str, alias: str) -> str | None:
        """The version behind ``alias`` as a string, or None when the alias (or the name) does not exist."""
        client = self.client()
        try:
            v = client.get_model_version_by_alias(name, alias) if kind == "model" else client.get_prompt_version_by_alias(name, alias)
        except Exception:
            return None
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

    def place_new_version(self, kind: str, name: str, version: str | int, production: str = "production",
                          challenger: str = "challenger", skip_gate: bool = False) -> str:
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
        """Download ``models:/name@alias`` to ``dest`` (cached per version); returns the model folder and version."""
        import mlflow.artifacts

        version = self.resolve_alias(name, alias)
        target = Path(dest) / f"{name}-v{version.version}"
        done = target / ".complete"
        if not done.exists():
            mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(target), tracking_uri=self.tracking_uri)
            done.touch()
        return model_dir(target), str(version.version)

    # -- prompts ------------------------------------------------------------------------------
    def register_prompt(self, name: str, template: str, alias: str | None, commit_message: str = "") -> RegisteredPrompt:
        """A new prompt version only when the text changed; ``alias`` (unless None) then points at it."""
        mlflow = self._mlflow()
        try:
            latest = mlflow.genai.load_prompt(f"prompts:/{name}@latest", link_to_model=False)
        except Exception:
            latest = None
        if latest is not None and latest.template == template:
            version, created = int(latest.version), False
        else:
            pv = mlflow.genai.register_prompt(name=name, template=template, commit_message=commit_message or None)
            version, created = int(pv.version), True
        if alias is not None:
            mlflow.genai.set_prompt_alias(name, alias, version)
        return RegisteredPrompt(name, version, alias or "", template, created)

    def load_prompt(self, name: str, alias: str) -> RegisteredPrompt:
        mlflow = self._mlflow()
        pv = mlflow.genai.load_prompt(f"prompts:/{name}@{alias}", link_to_model=False)
        return RegisteredPrompt(name, int(pv.version), alias, pv.template, created=False)


@contextmanager
def _pipeline_classes_resolved():
    """transformers 5 names pipeline classes as dotted strings in its task registry; MLflow 3.17's
    path-form logging reads ``impl.__name__``. Resolve the string to the class while logging."""
    import importlib

    from transformers import pipelines

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


def model_dir(root: Path) -> Path:
    """The folder holding config.json inside a downloaded MLflow transformers model."""
    for candidate in [root / "model", root]:
        if (candidate / "config.json").exists():
            return candidate
    hits = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    if not hits:
        raise FileNotFoundError(f"no config.json under downloaded model {root}")
    return hits[0].parent
