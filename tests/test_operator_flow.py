"""The operator's flow, driven by the daemon, as `make ui` starts it: the instance's long-lived local Ray
(`video-assets ray up`), then `dagster dev` running the webserver and the daemon on a temporary instance;
files dropped into the volume must become partitions and successful runs through the upload sensor alone,
and the UI must show the graph, the lineage and the tables' metadata. `ray down` stops the Ray after.

One server per module (started by the ``operator`` fixture), shared by the flow test and the
browser test. Select these with ``-m operator`` (or ``-m browser`` for the browser test only; every
end-to-end test, the CLI's included, with ``-m e2e``).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import polars as pl
import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from tests.fixtures.browser import launch, playwright_sync_api
from tests.fixtures.processes import free_port
from tests.fixtures.samples import REPO, copy_samples

BIN = Path(sys.executable).parent
FIRST_UPLOAD = ["realshort.mp4", "asl_eat.mkv"]  # 97 KB + 139 KB, 1.2 s + 1.6 s
SECOND_UPLOAD = ["carphone_distorted.mp4"]  # 7 KB, 4 s
PARTITIONS = "video_batches"
JOB = "batch_pipeline"

# Bounds on each wait (a healthy run is far below them; see the timings the fixture prints).
REGISTER_S = 240  # `dagster job execute -j register_model` (about 40 s here)
SERVER_START_S = 120  # webserver answering /server_info (about 15 s)
SENSOR_WAIT_S = 75  # sensor interval is 30 s; one tick's listing and hashing, plus slack
RUN_WAIT_S = 600  # queued -> launched -> every per-batch step (80-150 s on 2 CPUs alone; CI runs the vLLM check beside it: 270 s)
STOP_WAIT_S = 30  # SIGTERM -> SIGKILL

ARTIFACTS = REPO / "artifacts"  # git-ignored; CI collects it
SCREENSHOTS = ARTIFACTS / "screenshots"
# The UI's address of the one code location workspace.yaml loads (Definitions are "__repository__").
REPO_PATH = "__repository__@video_assets.definitions"
TERMINAL = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}

pytestmark = [pytest.mark.slow, pytest.mark.operator, pytest.mark.e2e]


def _defs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from video_assets.definitions import defs
    return defs


def batch_asset_keys() -> set[AssetKey]:
    """Every asset the sensor's job materialises, from the definitions (later stages join by themselves)."""
    return set(_defs().resolve_job_def(JOB).asset_layer.selected_asset_keys)


def poll(check, timeout: float, what: str, on_timeout=lambda: "", every: float = 1.0):
    """``check()`` until it returns something truthy; fail after ``timeout`` seconds with diagnostics."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}", pytrace=False)
        time.sleep(every)


class DagsterDev:
    """`dagster dev` in its own process group, logging to a file; stopped by process group."""

    def __init__(self, env: dict, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(BIN / "dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(self.port)],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the webserver, daemon, code servers and runs
        )

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        text = [line for line in text if "logging_progress.py" not in line]  # Ray Data's progress table
        return f"--- last {lines} lines of {self.log_path} ---\n" + "\n".join(text[-lines:])

    def wait_ready(self) -> None:
        def answering():
            if self.proc.poll() is not None:
                pytest.fail(f"dagster dev exited with {self.proc.returncode}\n{self.log_tail()}", pytrace=False)
            try:
                with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as resp:
                    return resp.status == 200
            except OSError:
                return False

        poll(answering, SERVER_START_S, f"dagster dev to answer on {self.url}", self.log_tail)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop(self) -> None:
        """SIGTERM to the whole group (dagster dev shuts its services down), SIGKILL what is left."""
        try:
            if self._group_alive():
                os.killpg(self.proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + STOP_WAIT_S
                while self._group_alive() and time.monotonic() < deadline:
                    self.proc.poll()  # reap the leader so the group can empty
                    time.sleep(0.5)
                if self._group_alive():
                    os.killpg(self.proc.pid, signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        finally:
            self._log.close()


class OperatorFlow:
    """A temporary instance and volume served by `dagster dev`, and the batches the sensor made."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "dagster_home"
        self.volume = root / "volume"
        self.tables = self.home / "tables"
        self.home.mkdir(parents=True)
        self.volume.mkdir()
        config = (REPO / "dagster_home" / "dagster.yaml").read_text()
        # The checked-in instance config, minus the UI's first-visit newsletter dialog.
        (self.home / "dagster.yaml").write_text(config + "\nnux:\n  enabled: false\n")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VLM_MODEL_SOURCE", "VLM_ENGINE")}
        self.env = {
            **env,
            "DAGSTER_HOME": str(self.home),
            "VIDEO_VOLUME_URI": str(self.volume),
            "VIDEO_TABLES_URI": str(self.tables),
            "MLFLOW_TRACKING_URI": f"sqlite:///{self.home / 'mlflow.db'}",
            "MLFLOW_ARTIFACT_ROOT": str(self.home / "mlartifacts"),
            "VLM_CACHE_DIR": str(self.home / "models"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "MLFLOW_ENABLE_TELEMETRY": "false",
            "PYTHONUNBUFFERED": "1",
        }
        self.server: DagsterDev | None = None
        self.ray_up = False
        self.instance: DagsterInstance | None = None
        self.expected = batch_asset_keys()
        self.batches: list[dict] = []  # {"key", "run_id", "files"} in the order the sensor made them
        self._failure: str | None = None
        self.timings: dict[str, float] = {}

    # --- set-up --------------------------------------------------------------------------------

    def register_model(self) -> None:
        started = time.monotonic()
        # In-process executor: two small steps, no need for a subprocess each.
        config = self.root / "in_process.yaml"
        config.write_text("execution:\n  config:\n    in_process: {}\n")
        cmd = [str(BIN / "dagster"), "job", "execute", "-m", "video_assets.definitions", "-j", "register_model"]
        proc = subprocess.run(
            cmd + ["-c", str(config)], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=REGISTER_S
        )
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        self.timings["register_model"] = time.monotonic() - started

    def ray_service(self, command: str) -> None:
        """`video-assets ray up|down` on this instance (`make ui` starts the service before the server and
        stops it after: every step joins that Ray, and the caption model stays loaded between batches)."""
        started = time.monotonic()
        cmd = [str(BIN / "video-assets"), "ray", command]
        done = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        self.ray_up = command == "up"
        self.timings[f"ray_{command}"] = time.monotonic() - started

    def start_server(self) -> None:
        started = time.monotonic()
        self.server = DagsterDev(self.env, self.root / "dagster_dev.log")
        self.server.wait_ready()
        self.timings["server_ready"] = time.monotonic() - started
        # The test reads the same sqlite storage the server writes. dagster.yaml resolves
        # DAGSTER_HOME from the environment when the instance is loaded.
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DAGSTER_HOME", str(self.home))
            self.instance = DagsterInstance.get()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.instance is not None:
            self.instance.dispose()
        if self.ray_up:  # `make ui`'s trap: the service and every process of its session, by PID
            self.ray_service("down")

    # --- uploads and what the daemon makes of them ---------------------------------------------

    def upload(self, names: list[str]) -> None:
        """Copy as an uploader should: under a hidden name the sensor ignores, then rename into place."""
        staged = copy_samples(self.root / "staging", names)
        for path in staged:
            part = self.volume / f".{path.name}.part"
            shutil.copy(path, part)
            os.replace(part, self.volume / path.name)

    def partitions(self) -> list[str]:
        return self.instance.get_dynamic_partitions(PARTITIONS)

    def runs_for(self, key: str):
        return self.instance.get_runs(RunsFilter(job_name=JOB, tags={"dagster/partition": key}))

    def materializations(self, asset: AssetKey, key: str):
        records = self.instance.fetch_materializations(
            AssetRecordsFilter(asset_key=asset, asset_partitions=[key]), limit=100
        ).records
        return records

    def diagnose(self, run_id: str | None = None) -> str:
        parts = [self.server.log_tail(100) if self.server else "(no server)"]
        if run_id and self.instance:
            wanted = {DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE, DagsterEventType.ENGINE_EVENT}
            parts.append(f"--- failure events of run {run_id} ---")
            for entry in self.instance.all_logs(run_id, of_type=wanted):
                event = entry.dagster_event
                error = getattr(event.event_specific_data, "error", None)
                if event.event_type == DagsterEventType.ENGINE_EVENT and error is None:
                    continue  # engine events are only interesting when they carry an error
                parts.append(f"{event.event_type_value} {event.step_key or ''}: {event.message}")
                if error is not None:
                    parts.append(error.to_string())
        return "\n".join(parts)

    def _wait_for_batch(self, files: list[str], upload: bool) -> dict:
        known = {b["key"] for b in self.batches}
        started = time.monotonic()
        if upload:
            self.upload(files)
        new = poll(
            lambda: [k for k in self.partitions() if k not in known],
            SENSOR_WAIT_S,
            f"upload_sensor to add a {PARTITIONS} partition for {files}",
            self.diagnose,
        )
        assert len(new) == 1, f"one upload should make one batch, got {new}"
        key = new[0]
        self.timings[f"batch {len(self.batches) + 1}: partition"] = time.monotonic() - started
        run = poll(lambda: self.runs_for(key), SENSOR_WAIT_S, f"a {JOB} run for partition {key}", self.diagnose)
        assert len(run) == 1, f"the sensor made {len(run)} runs for {key}"
        run_id = run[0].run_id
        done = poll(
            lambda: (r := self.instance.get_run_by_id(run_id)).status in TERMINAL and r,
            RUN_WAIT_S,
            f"run {run_id} ({key}) to finish",
            lambda: self.diagnose(run_id),
            every=2,
        )
        self.timings[f"batch {len(self.batches) + 1}: run finished"] = time.monotonic() - started
        assert done.status == DagsterRunStatus.SUCCESS, (
            f"run {run_id} for {key} ended {done.status.value}\n{self.diagnose(run_id)}"
        )
        batch = {"key": key, "run_id": run_id, "files": files, "tags": done.tags}
        self.batches.append(batch)
        return batch

    def ensure_batches(self, count: int) -> list[dict]:
        """The first ``count`` uploads, each turned into a batch by the daemon (once per module)."""
        uploads = [FIRST_UPLOAD, SECOND_UPLOAD]
        if self._failure:
            pytest.fail(f"an earlier step of the operator flow failed: {self._failure}", pytrace=False)
        try:
            while len(self.batches) < count:
                # The first upload is already in the volume when the server starts.
                self._wait_for_batch(uploads[len(self.batches)], upload=bool(self.batches))
        except BaseException as exc:
            self._failure = f"{type(exc).__name__}: {str(exc)[:300]}"
            raise
        return self.batches[:count]


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    flow = OperatorFlow(tmp_path_factory.mktemp("operator"))
    copy_samples(flow.volume, FIRST_UPLOAD)  # the first upload is waiting when the sensor first ticks
    try:
        flow.register_model()  # the sensor's run captions, which needs the model and prompt registered
        flow.ray_service("up")
        flow.start_server()
        yield flow
    finally:
        stopped = time.monotonic()
        flow.stop()
        flow.timings["server_stop"] = time.monotonic() - stopped
        print("\noperator flow timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in flow.timings.items()))
        out = ARTIFACTS / "operator_flow"
        out.mkdir(parents=True, exist_ok=True)
        (out / "timings.json").write_text(json.dumps(flow.timings, indent=1))
        if flow.server is not None:
            shutil.copy(flow.server.log_path, out / "dagster_dev.log")


def test_uploads_become_batches_and_runs_through_the_daemon(operator):
    expected = operator.expected
    assert {AssetKey("raw_videos"), AssetKey("video_metadata"), AssetKey("captions")} <= expected

    (first,) = operator.ensure_batches(1)
    assert operator.partitions() == [first["key"]]
    assert first["tags"].get("dagster/sensor_name") == "upload_sensor"
    assert first["tags"].get("dagster/run_key") == first["key"]
    for asset in expected:
        records = operator.materializations(asset, first["key"])
        assert [r.run_id for r in records] == [first["run_id"]], f"{asset.to_user_string()} for {first['key']}"

    _, second = operator.ensure_batches(2)
    assert operator.partitions() == [first["key"], second["key"]]
    manifest = pl.read_delta(str(operator.tables / "batch_manifest"))
    members = {
        key: sorted(Path(u).name for u in manifest.filter(pl.col("batch_key") == key)["uri"])
        for key in (first["key"], second["key"])
    }
    assert members == {first["key"]: sorted(FIRST_UPLOAD), second["key"]: sorted(SECOND_UPLOAD)}
    for asset in expected:
        records = operator.materializations(asset, second["key"])
        assert [r.run_id for r in records] == [second["run_id"]], f"{asset.to_user_string()} for {second['key']}"
        # The first batch was not materialised again by the second tick or run.
        records = operator.materializations(asset, first["key"])
        assert [r.run_id for r in records] == [first["run_id"]], f"{asset.to_user_string()} rematerialised"
    assert [r.run_id for r in operator.runs_for(first["key"])] == [first["run_id"]]
    # Both runs' steps joined the Ray service: one caption application answered both batches.
    served = [
        operator.materializations(AssetKey("captions"), b["key"])[0]
        .asset_materialization.metadata["engine_service"]
        .value
        for b in (first, second)
    ]
    assert served[0]["mode"] == "served" and served[1]["application"] == served[0]["application"], served
    meta = pl.read_delta(str(operator.tables / "video_metadata"))
    assert sorted(Path(u).name for u in meta["uri"]) == sorted(FIRST_UPLOAD + SECOND_UPLOAD)
    assert meta["ok"].all()


# --- the UI in a real browser --------------------------------------------------------------------


@pytest.fixture(scope="module")
def playwright_api():
    """Playwright's sync API and Debian's Chromium, checked before the server starts: missing in CI
    (CI set, as .ci/run does) is a failure, elsewhere a skip."""
    return playwright_sync_api()


def _node(page, name: str):
    """An asset's node in the rendered graph (nodes are HTML inside the graph's SVG foreignObjects).
    A long name is shown truncated in the middle ("promoti…_decisions"): match that form too."""
    shown = re.compile(rf"^(?:{re.escape(name)}|{re.escape(name[:4])}[^…]*…[^…]*{re.escape(name[-4:])})$")
    return page.locator("svg foreignObject").get_by_text(shown).first


def _centre_x(page, name: str) -> float:
    box = _node(page, name).bounding_box()
    assert box, f"{name} has no box on the page"
    return box["x"] + box["width"] / 2


@pytest.mark.browser
def test_ui_shows_graph_lineage_and_metadata(playwright_api, operator):  # browser checked first
    sync_playwright, expect = playwright_api.sync_playwright, playwright_api.expect
    operator.ensure_batches(1)  # after the flow test both batches exist; run alone, one will do
    latest = operator.batches[-1]
    graph = _defs().resolve_asset_graph()
    parents = sorted(k.to_user_string() for k in graph.get(AssetKey("video_metadata")).parent_keys)
    children = sorted(k.to_user_string() for k in graph.get(AssetKey("video_metadata")).child_keys)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "failure.png").unlink(missing_ok=True)
    errors: list[str] = []

    expect.set_options(timeout=30_000)

    with sync_playwright() as pw:
        browser = launch(pw)
        # Tall: a group page renders only the nodes inside the view, and the models group is tall.
        page = browser.new_page(viewport={"width": 1600, "height": 2400})
        page.set_default_timeout(30_000)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        step = "start"
        try:
            # 1. Global asset lineage: groups start collapsed; ⌥E (Alt+E) expands them all.
            step = "global asset graph"
            page.goto(f"{operator.server.url}/asset-groups")
            expect(page.get_by_text("Global asset lineage").first).to_be_visible()
            for group in sorted({graph.get(k).group_name for k in graph.get_all_asset_keys()}):
                expect(page.get_by_text(group, exact=True).first).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "01_global_asset_lineage.png"), full_page=True)
            # Zoomed out far enough to fit the whole graph, the UI draws nodes without labels: check each
            # group's own lineage page instead, where every asset of the group is drawn named, with the
            # dependencies inside the group as arrowed paths.
            for group in sorted({graph.get(k).group_name for k in graph.get_all_asset_keys()}):
                step = f"group {group} lineage"
                members = {k for k in graph.get_all_asset_keys() if graph.get(k).group_name == group}
                inner = sum(len(graph.get(k).parent_keys & members) for k in members)
                page.goto(f"{operator.server.url}/locations/{REPO_PATH}/asset-groups/{group}")
                names = {k.to_user_string() for k in members}
                expect(page.locator("svg foreignObject").first).to_be_visible()
                # Only nodes inside the view are rendered: a group taller than the view is seen zoom
                # step by step (a group is small enough that its labels are still drawn).
                seen: set[str] = set()
                for _ in range(5):
                    page.wait_for_timeout(500)
                    seen |= {name for name in names - seen if _node(page, name).is_visible()}
                    if seen == names:
                        break
                    page.get_by_role("button", name="zoom_out").click()
                assert seen == names, f"{group}: never shown: {sorted(names - seen)}"
                edge_paths = page.locator("svg path[marker-end]")
                poll(
                    lambda p=edge_paths, n=inner: p.count() >= n,
                    20,
                    f"{inner} edges in {group}",
                    lambda p=edge_paths: str(p.count()),
                )
                page.screenshot(path=str(SCREENSHOTS / f"01_group_{group}.png"), full_page=True)

            # 2. video_metadata's lineage tab: its neighbours, upstream on the left, downstream right.
            step = "video_metadata lineage"
            page.goto(f"{operator.server.url}/assets/video_metadata?view=lineage")
            for name in parents + ["video_metadata"] + children:
                expect(_node(page, name)).to_be_visible()
            edge_paths = page.locator("svg path[marker-end]")
            want = len(parents) + len(children)
            poll(lambda: edge_paths.count() >= want, 20, f"{want} lineage edges", lambda: str(edge_paths.count()))
            x = _centre_x(page, "video_metadata")
            assert all(_centre_x(page, p) < x for p in parents), "upstream assets are not left of video_metadata"
            assert all(_centre_x(page, c) > x for c in children), "downstream assets are not right of video_metadata"
            page.screenshot(path=str(SCREENSHOTS / "02_video_metadata_lineage.png"), full_page=True)

            # 3. The latest materialisation's metadata: uri, row counts, the preview of that batch.
            step = "video_metadata events"
            page.goto(f"{operator.server.url}/assets/video_metadata?view=events")
            expect(page.get_by_text(f"Partition {latest['key']} materialized in run").first).to_be_visible()
            for label in ("dagster/uri", "dagster/row_count", "table_row_count", "preview"):
                expect(page.get_by_text(label, exact=True).first).to_be_visible()
            expect(page.get_by_text(str(operator.tables / "video_metadata")).first).to_be_visible()
            for name in latest["files"]:
                expect(page.get_by_text(name).first).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "03_video_metadata_events.png"), full_page=True)

            # 4. The captions asset page: latest materialisation and row count on its overview.
            step = "captions overview"
            page.goto(f"{operator.server.url}/assets/captions")
            expect(page.get_by_text("Latest materialization").first).to_be_visible()
            expect(page.get_by_text(latest["key"]).first).to_be_visible()
            expect(page.get_by_text("Row count").first).to_be_visible()
            page.screenshot(path=str(SCREENSHOTS / "04_captions_overview.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(SCREENSHOTS / "failure.png"), full_page=True)
            print(f"browser step {step!r} failed at {page.url}; page errors: {errors}")
            print(page.inner_text("body")[:3000])
            raise
        finally:
            browser.close()
