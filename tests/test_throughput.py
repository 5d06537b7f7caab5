"""The throughput model (pure): the slower stage bounds the stream, workers an engine leaves are the
ones that decode, and a calibration run is reproduced exactly."""

import pytest

from video_assets.core.throughput import StageCosts, decode_workers, predict

COSTS = StageCosts(startup_s=10.0, decode_cpu_s_per_video_s=0.2, engine_s_per_request=0.5, requests_per_video_s=0.1)


def test_the_slower_stage_bounds_the_stream_and_more_decode_workers_stop_helping():
    hour = 3600.0
    one = predict(COSTS, hour, cpu_workers=1)  # decode 720 s vs engine 180 s
    assert one.bound_by == "decode" and one.wall_s == pytest.approx(10 + 720 + 180 / 360)
    assert one.cpu_to_accelerator == pytest.approx(4.0) and one.best_cpu_workers == 4
    four = predict(COSTS, hour, cpu_workers=4)
    eight = predict(COSTS, hour, cpu_workers=8)
    assert four.wall_s < one.wall_s and eight.bound_by == "engine"
    assert eight.wall_s == pytest.approx(predict(COSTS, hour, cpu_workers=16).wall_s, rel=0.01)  # engine-bound
    assert predict(COSTS, hour, cpu_workers=8, engines=2).wall_s < eight.wall_s
    assert predict(COSTS, 2 * hour, 4).wall_s - four.wall_s == pytest.approx(four.wall_s - 10, rel=0.01)
    with pytest.raises(ValueError):
        predict(COSTS, hour, cpu_workers=0)


def test_decode_workers_are_the_cpus_engines_leave():
    assert decode_workers(cpu_concurrency=2, cluster_cpus=2, engines=1) == 1
    assert decode_workers(cpu_concurrency=8, cluster_cpus=16, engines=2) == 8
    assert decode_workers(cpu_concurrency=8, cluster_cpus=4, engines=4) == 1


def test_calibration_reproduces_its_own_run():
    cost = {"wall_s": {"total": 30.0, "setup": 3.0}, "busy_s": {"decode_cpu": 12.0, "generation": 4.0}}
    costs = StageCosts.from_run(cost, video_s=60.0, requests=8, cpu_workers=2)
    assert costs.decode_cpu_s_per_video_s == pytest.approx(0.2) and costs.engine_s_per_request == pytest.approx(0.5)
    assert predict(costs, 60.0, 2).wall_s == pytest.approx(30.0)
    with pytest.raises(ValueError, match="captioned video"):
        StageCosts.from_run(cost, video_s=0, requests=0)


def test_two_calibration_runs_separate_the_fixed_cost_from_the_per_request_cost():
    truth = StageCosts(
        startup_s=2.0,
        decode_cpu_s_per_video_s=0.1,
        engine_s_per_request=0.05,
        requests_per_video_s=0.25,
        per_request_s=0.1,
    )

    def run(video_s):  # what a materialisation's metadata would say if the model were the truth
        requests = int(truth.requests_per_video_s * video_s)
        cost = {
            "wall_s": {"total": predict(truth, video_s, 1).wall_s},
            "busy_s": {"decode_cpu": truth.decode_cpu_s_per_video_s * video_s, "generation": 0.05 * requests},
        }
        return cost, video_s, requests

    small, larger, large = run(16.0), run(48.0), run(960.0)
    fitted = StageCosts.from_runs([small, larger], cpu_workers=1)
    assert fitted.startup_s == pytest.approx(2.0) and fitted.per_request_s == pytest.approx(0.1)
    assert predict(fitted, 960.0, 1).wall_s == pytest.approx(large[0]["wall_s"]["total"])
    # One run cannot tell the two apart: it puts everything in the fixed cost, and underestimates.
    single = StageCosts.from_run(*small, cpu_workers=1)
    assert single.per_request_s == 0 and predict(single, 960.0, 1).wall_s < 0.9 * large[0]["wall_s"]["total"]


def test_a_steps_setup_cost_counts_from_its_own_start_not_the_runs(instance):
    """The cost breakdown's ``setup`` is the step's own resource set-up: another step that ran before it
    in the same run (and the planning events at the run's start) must not count."""
    import time

    from dagster import AssetExecutionContext, MaterializeResult, asset, materialize

    from video_assets.defs.common import CostBreakdown

    @asset
    def slow_first() -> None:
        time.sleep(1)  # long enough that counting it would show: the bracket below is a few ms wide

    body = {}

    @asset(deps=[slow_first])
    def timed(context: AssetExecutionContext) -> MaterializeResult:
        body["before"] = time.time()
        cost = CostBreakdown(context)
        body["after"] = time.time()
        return MaterializeResult(metadata={"cost": cost.metadata()})

    result = materialize([slow_first, timed], instance=instance)
    wall = result.asset_materializations_for_node("timed")[0].metadata["cost"].value["wall_s"]
    events = [e for e in instance.all_logs(result.run_id) if e.dagster_event is not None]
    starts = {e.step_key: e.timestamp for e in events if e.dagster_event.event_type_value == "STEP_START"}
    run_began = min(e.timestamp for e in events)
    slow_done = max(e.timestamp for e in events if e.step_key == "slow_first")
    # Not a wall-clock bound: the setup is the span from this step's own STEP_START to the body (bracketed by
    # the clock read just before and after the breakdown was made; metadata rounds to 1 ms). Counted from the
    # run's start it would also hold slow_first's step, which ended before this step started.
    assert run_began < starts["slow_first"] < slow_done <= starts["timed"]
    assert body["before"] - starts["timed"] - 0.001 <= wall["setup"] <= body["after"] - starts["timed"] + 0.001, (
        wall,
        body,
        starts,
    )


def test_vllm_engine_time_counts_overlapping_requests_once():
    from video_assets.core.throughput import covered_seconds

    # Four requests in flight together for 0-10 s, then one alone for 12-15 s: busy 13 s, not 43.
    assert covered_seconds([(0, 10), (0, 10), (2, 10), (5, 10), (12, 15)]) == 13
    assert covered_seconds([(0, 4), (3, 6)]) == 6
    assert covered_seconds([]) == 0


def test_decode_beside_vllm_follows_the_cluster():
    from video_assets.core.throughput import vllm_decode_workers

    # A 16-CPU GPU node with one engine and two CPU stages of up to 4 actors: 7 decode tasks, not 2.
    assert vllm_decode_workers(2, 16, engines=1, cpu_stage_actors=8) == 7
    # An 8-GPU node with 128 CPUs: the decode stage widens with it.
    assert vllm_decode_workers(2, 128, engines=8, cpu_stage_actors=8) == 112
    # Never below the configured width (a small cluster, or Ray not told about every CPU).
    assert vllm_decode_workers(2, 4, engines=1, cpu_stage_actors=8) == 2


def test_decode_beside_vllm_is_sized_to_its_engines_by_the_calibrated_model():
    """The decode width of a vLLM job: what the cluster's CPUs leave at its start, raised to what keeps the
    engines busy by the ratio measured on earlier vLLM batches (demand an autoscaling cluster grows for),
    never lowered by it."""
    from video_assets.core.captioning.batch import EngineSpec, JobSpec
    from video_assets.core.captioning.job import decode_slots
    from video_assets.core.inference.model_cache import ModelFiles
    from video_assets.core.media.sampling import SamplingConfig
    from video_assets.core.throughput import calibrated_cpu_to_accelerator, decode_width

    assert decode_width(2, None, engines=8) == 2  # nothing measured yet: the cluster of the moment
    assert decode_width(2, 4.0, engines=8) == 32  # 4 decode CPU s per engine s, 8 engines
    assert decode_width(40, 0.5, engines=8) == 40  # calibrated on smaller hardware: never fewer than now
    assert decode_width(3, 1.01, engines=2) == 3 and decode_width(2, 1.01, engines=2) == 3  # rounded up

    run = {"busy_s": {"decode_cpu": 30.0, "generation": 10.0}}
    idle = {"busy_s": {"decode_cpu": 5.0, "generation": 0.0}}
    assert calibrated_cpu_to_accelerator([(run, 60.0, 6), (run, 120.0, 12)]) == pytest.approx(3.0)
    assert calibrated_cpu_to_accelerator([]) is None and calibrated_cpu_to_accelerator([(idle, 1.0, 1)]) is None

    def spec(ratio, engines=2, resources=None):
        files = ModelFiles("/m", "", "/c", "", "")
        vllm = {"model_source": "/m", "concurrency": engines, "cpu_stage_max_actors": 1}
        return JobSpec(
            SamplingConfig(),
            EngineSpec("vllm", files),
            "p",
            vllm=vllm,
            cpu_to_accelerator=ratio,
            cpu_resources=resources or {},
        )

    # A GPU group scaling from zero: at job start the head's 4 CPUs, 2 engines, 2 CPU-stage actors.
    assert decode_slots(spec(None), cluster_cpus=4) == 2
    assert decode_slots(spec(3.0), cluster_cpus=4) == 6
    assert decode_slots(spec(3.0), cluster_cpus=64) == 60  # a big cluster already: its CPUs
    assert decode_slots(spec(3.0, resources={"decode": 1}), cluster_cpus=64) == 2  # pinned: as configured


def test_the_accelerator_pool_is_set_from_the_command_line(dagster_home, monkeypatch, capsys):
    """`video-assets pools`: the accelerator pool's slots on the instance (dagster.yaml cannot take them
    from the environment) and the run limit in dagster.yaml; --from-cluster only with a cluster (an embedded
    Ray per step sees every GPU)."""
    from dagster import DagsterInstance

    from video_assets.cli import main
    from video_assets.core.throughput import accelerator_slots
    from video_assets.defs.common import ACCELERATOR_POOL

    def run_limit() -> int:
        with DagsterInstance.get() as instance:  # a new instance reads dagster.yaml again, as a restarted daemon
            return instance.get_concurrency_config().run_queue_config.max_concurrent_runs

    assert run_limit() == 2  # the laptop default (dagster_home/dagster.yaml)
    assert main(["pools", "--slots", "3"]) == 0
    with DagsterInstance.get() as instance:
        assert instance.event_log_storage.get_concurrency_info(ACCELERATOR_POOL).slot_count == 3
    assert run_limit() == 4  # one run more than the slots: a run in its CPU stages beside those on the GPUs
    assert "max_concurrent_runs: 4" in (dagster_home / "dagster.yaml").read_text()
    assert main(["pools", "--slots", "1"]) == 0 and run_limit() == 2
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["pools", "--from-cluster"]) == 2
    assert main(["pools", "--slots", "0"]) == 2
    # A dagster.yaml without the line is not guessed at: the command says what to set.
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    assert main(["pools", "--slots", "2"]) == 2
    assert "max_concurrent_runs: <n>` line: set it to 3 by hand" in capsys.readouterr().err
    # One slot per engine group the GPUs hold, never none.
    assert [accelerator_slots(8, 1), accelerator_slots(8, 2), accelerator_slots(3, 2), accelerator_slots(0, 1)] == [
        8,
        4,
        1,
        1,
    ]


def test_a_serve_config_needs_the_cluster_that_will_serve_it(dagster_home, monkeypatch, capsys):
    """`video-assets ray serve-config` without a Ray that outlives the steps (no RAY_ADDRESS, no `ray up`):
    an error naming the setting, and nothing written (steps with an embedded Ray load their own engine)."""
    from video_assets.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = dagster_home / "captioner.yaml"
    assert main(["ray", "serve-config", "--output", str(out)]) == 2
    assert "RAY_ADDRESS" in capsys.readouterr().err and not out.exists()


def test_the_cluster_gpus_an_engine_can_use_follow_its_accelerator_type():
    """Engines pinned to a GPU type (vLLM's ``accelerator_type``) count only the nodes of that type; dead
    nodes never count."""
    from video_assets.core.throughput import cluster_gpus

    nodes = [
        {"Alive": True, "Resources": {"CPU": 16, "GPU": 8, "accelerator_type:H100": 1}},
        {"Alive": True, "Resources": {"CPU": 8, "GPU": 4, "accelerator_type:L4": 1}},
        {"Alive": False, "Resources": {"CPU": 16, "GPU": 8, "accelerator_type:H100": 1}},
        {"Alive": True, "Resources": {"CPU": 4}},
    ]
    assert [
        cluster_gpus(nodes),
        cluster_gpus(nodes, "H100"),
        cluster_gpus(nodes, "L4"),
        cluster_gpus(nodes, "A100"),
    ] == [
        12,
        8,
        4,
        0,
    ]
