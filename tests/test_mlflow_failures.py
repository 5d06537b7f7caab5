"""MLflow failures: an unreachable store fails a step in seconds, naming the setting; a registry error
other than "not found" fails the step instead of being read as "no alias" (which let an unevaluated
version past the promotion gate), re-registering or creating spurious prompt versions.

Faults are injected into a real MlflowClient on a real SQLite store: one named call raises the
MlflowException a flaky server would (TEMPORARILY_UNAVAILABLE); every other call is the real one."""

import os
import socket

import pytest
from dagster import build_sensor_context, materialize
from dagster_ray import LocalRay
from dagster_ray.configs import Lifecycle
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from pydantic import Field

from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from resources.mlflow_registry import MlflowRegistry, MlflowUnavailable, is_not_found
from resources.structurer import StructurerSettings
from resources.vlm import VlmSettings
from tests.fixtures.processes import free_port
from video_assets.core.tables import PROMOTIONS
from video_assets.defs.models.assets import CAPTION_PROMPT_NAME, caption_prompt
from video_assets.defs.promotion.assets import promotion
from video_assets.defs.promotion.sensors import challenger_sensor

MODEL = "video-captioner"


class FaultyClient(MlflowClient):
    """A real client whose calls named in ``fail`` ("method" or "method:last-argument") raise; only the
    first such call when ``once_flag`` (a file created when the fault fires) is given."""

    def __init__(self, *args, fail: frozenset[str], once_flag: str | None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fail, self._once_flag = fail, once_flag

    def _check(self, method: str, *args) -> None:
        if method in self._fail or (args and f"{method}:{args[-1]}" in self._fail):
            if self._once_flag is not None:
                if os.path.exists(self._once_flag):
                    return
                open(self._once_flag, "w").close()
            raise MlflowException(f"injected fault in {method}: try again later", error_code=TEMPORARILY_UNAVAILABLE)

    def get_model_version_by_alias(self, name, alias):
        self._check("get_model_version_by_alias", name, alias)
        return super().get_model_version_by_alias(name, alias)

    def get_prompt_version_by_alias(self, name, alias):
        self._check("get_prompt_version_by_alias", name, alias)
        return super().get_prompt_version_by_alias(name, alias)

    def load_prompt(self, name_or_uri, *args, **kwargs):
        self._check("load_prompt", name_or_uri)
        return super().load_prompt(name_or_uri, *args, **kwargs)

    def search_model_versions(self, *args, **kwargs):
        self._check("search_model_versions")
        return super().search_model_versions(*args, **kwargs)


class FaultyRegistry(MlflowRegistry):
    fail: list[str] = Field(default_factory=list)
    once_flag: str | None = None

    def client(self):
        return FaultyClient(
            tracking_uri=self.tracking_uri,
            registry_uri=self.tracking_uri,
            fail=frozenset(self.fail),
            once_flag=self.once_flag,
        )


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def _failure_text(result) -> str:
    """The messages (and their causes) of the run's failure events: a step's, or a resource's init."""
    texts = []
    for event in result.all_events:
        err = getattr(event.event_specific_data, "error", None)
        while err is not None:
            texts.append(err.message)
            err = err.cause
    assert texts, "no failure event"
    return "\n".join(texts)


# -- unreachable ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("server", ["closed port", "silent listener"])
def test_an_unreachable_tracking_server_fails_the_step_in_seconds(instance, server, tmp_path):
    """In seconds, shown by what happened rather than a clock: one GET /health (no client retries), refused or
    waited out for ``preflight_timeout_s``, fails the step before any work, naming the setting and the cause."""
    listener = None
    if server == "closed port":
        port = free_port()
    else:  # accepts connections (the kernel's backlog) but never answers: the hang the client retries
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
    registry = MlflowRegistry(tracking_uri=f"http://127.0.0.1:{port}", preflight_timeout_s=3)
    try:
        result = materialize(
            [caption_prompt],
            instance=instance,
            resources={"vlm": VlmSettings(cache_dir=str(tmp_path)), "mlflow_registry": registry},
            raise_on_error=False,
        )
        connections = 0
        if listener is not None:  # every connection the step opened waits in the backlog: count them
            listener.setblocking(False)
            while True:
                try:
                    listener.accept()[0].close()
                except BlockingIOError:
                    break
                connections += 1
    finally:
        if listener is not None:
            listener.close()
    assert not result.success
    text = _failure_text(result)
    assert "MLFLOW_TRACKING_URI" in text and f"127.0.0.1:{port}" in text, text
    assert "did not answer GET /health within 3 s" in text, text
    if listener is None:
        assert "Connection refused" in text, text
    else:  # one request, waited out once: not the MLflow client's retries with backoff (minutes)
        assert "timed out" in text and connections == 1, (connections, text)
    assert result.get_asset_materialization_events() == []  # failed before any work
    with pytest.raises(MlflowUnavailable):
        registry.check_reachable()


def test_a_missing_sqlite_folder_is_reported_before_any_work(instance, tmp_path):
    registry = MlflowRegistry(tracking_uri=f"sqlite:///{tmp_path}/no/such/folder/mlflow.db")
    result = materialize(
        [caption_prompt],
        instance=instance,
        resources={"vlm": VlmSettings(cache_dir=str(tmp_path)), "mlflow_registry": registry},
        raise_on_error=False,
    )
    assert not result.success and "MLFLOW_TRACKING_URI" in _failure_text(result)
    assert not (tmp_path / "no").exists()


# -- not found vs. any other error ------------------------------------------------------------------------
def test_only_not_found_means_no_alias(store):
    registry = MlflowRegistry(tracking_uri=store)
    assert registry.alias_version("model", MODEL, "production") is None  # no such model
    registry.client().create_registered_model(MODEL)
    assert registry.alias_version("model", MODEL, "production") is None  # no such alias
    assert registry.alias_version("prompt", CAPTION_PROMPT_NAME, "production") is None
    assert is_not_found(
        MlflowException("Registered model alias production not found.", error_code=INVALID_PARAMETER_VALUE)
    )
    assert not is_not_found(MlflowException("bad filter", error_code=INVALID_PARAMETER_VALUE))
    faulty = FaultyRegistry(tracking_uri=store, fail=["get_model_version_by_alias"])
    with pytest.raises(RuntimeError, match="MLFLOW_TRACKING_URI"):
        faulty.alias_version("model", MODEL, "production")
    with pytest.raises(MlflowException, match="injected"):
        FaultyRegistry(tracking_uri=store, fail=["search_model_versions"]).find_version(MODEL, "t", "v")


def _prompt_versions(store: str) -> int:
    return len(MlflowClient(tracking_uri=store).search_prompt_versions(CAPTION_PROMPT_NAME))


def _retried_errors(result) -> list[str]:
    """The error of every attempt that failed and was retried (the step's RetryPolicy)."""
    return [
        e.event_specific_data.error.to_string() for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"
    ]


def test_a_registry_error_while_placing_a_new_prompt_leaves_production_alone(instance, store, tmp_path):
    # Production holds an older prompt text; the prompt file's text is new, so materialising registers a
    # new version and must put it behind challenger. The first lookup of production fails: the attempt
    # fails (the catch-all read it as "no production" and moved production to the new version), the
    # retry places the version registered by the first attempt behind challenger.
    MlflowRegistry(tracking_uri=store).register_prompt(CAPTION_PROMPT_NAME, "an older prompt", alias="production")
    faulty = FaultyRegistry(
        tracking_uri=store, fail=["get_prompt_version_by_alias:production"], once_flag=str(tmp_path / "fired")
    )
    result = materialize(
        [caption_prompt],
        instance=instance,
        resources={"vlm": VlmSettings(cache_dir=str(tmp_path)), "mlflow_registry": faulty},
    )
    assert result.success and (tmp_path / "fired").exists()
    [retried] = _retried_errors(result)
    assert "injected fault" in retried and "MLFLOW_TRACKING_URI" in retried
    registry = MlflowRegistry(tracking_uri=store)
    assert registry.alias_version("prompt", CAPTION_PROMPT_NAME, "production") == "1"  # not moved
    assert registry.alias_version("prompt", CAPTION_PROMPT_NAME, "challenger") == "2"
    assert _prompt_versions(store) == 2  # the retry found the first attempt's version: no duplicate


def test_a_registry_error_reading_the_latest_prompt_creates_no_version(instance, store, tmp_path):
    resources = {"vlm": VlmSettings(cache_dir=str(tmp_path))}
    registry = MlflowRegistry(tracking_uri=store)
    assert materialize(
        [caption_prompt], instance=instance, resources={**resources, "mlflow_registry": registry}
    ).success
    faulty = FaultyRegistry(
        tracking_uri=store,
        fail=[f"load_prompt:prompts:/{CAPTION_PROMPT_NAME}@latest"],
        once_flag=str(tmp_path / "fired"),
    )
    result = materialize([caption_prompt], instance=instance, resources={**resources, "mlflow_registry": faulty})
    assert result.success and (tmp_path / "fired").exists()
    [retried] = _retried_errors(result)
    assert "injected fault" in retried
    assert _prompt_versions(store) == 1  # the catch-all registered the same text again as version 2
    assert registry.alias_version("prompt", CAPTION_PROMPT_NAME, "production") == "1"


def test_the_promotion_gate_under_an_injected_registry_error(instance, store, tmp_path):
    # Production v1 and challenger v2 of the model, a production prompt. Reading the challenger alias
    # fails: the promotion step must fail, not conclude "no challenger" and succeed.
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    client.create_registered_model(MODEL)
    for v in ("1", "2"):
        (tmp_path / f"m{v}").mkdir()
        client.create_model_version(MODEL, str(tmp_path / f"m{v}"))
    client.set_registered_model_alias(MODEL, "production", "1")
    client.set_registered_model_alias(MODEL, "challenger", "2")
    MlflowRegistry(tracking_uri=store).register_prompt(CAPTION_PROMPT_NAME, "a prompt", alias="production")

    faulty = FaultyRegistry(tracking_uri=store, fail=["get_model_version_by_alias:challenger"])
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    resources = {
        "vlm": VlmSettings(cache_dir=str(tmp_path / "models")),
        "structurer": StructurerSettings(),
        "mlflow_registry": faulty,
        "tables": tables,
        "ray_cluster": LocalRay(lifecycle=Lifecycle(connect=False)),  # never reached: nothing to run on Ray
        "alert_delivery": AlertDestinations(),
    }
    result = materialize([promotion], instance=instance, resources=resources, raise_on_error=False)
    assert not result.success
    text = _failure_text(result)
    assert "challenger" in text and "MLFLOW_TRACKING_URI" in text, text
    assert str(client.get_model_version_by_alias(MODEL, "production").version) == "1"
    assert str(client.get_model_version_by_alias(MODEL, "challenger").version) == "2"
    assert not tables.exists(PROMOTIONS)  # no decision, and no alias moved

    # The opt-in sensor reports the error rather than skipping as if there were no challenger.
    with pytest.raises(Exception, match="injected fault"):
        challenger_sensor(
            build_sensor_context(
                instance=instance, resources={"vlm": VlmSettings(cache_dir=str(tmp_path)), "mlflow_registry": faulty}
            )
        )


def test_steps_first_touching_a_new_sqlite_store_at_once_all_succeed(tmp_path):
    """The register_model job's steps start together on a fresh instance: each opens the new SQLite
    store, and without the preflight's file lock their schema migrations raced (all but one failed)."""
    import subprocess
    import sys

    code = (
        "import sys; from resources.mlflow_registry import MlflowRegistry; "
        "MlflowRegistry(tracking_uri=sys.argv[1], artifact_root=sys.argv[2]).check_reachable()"
    )
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, uri, str(tmp_path / "art")], stderr=subprocess.PIPE, text=True)
        for _ in range(5)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 5, errors
