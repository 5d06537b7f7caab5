"""Live cameras, first part: cameras as configuration and the recorder (core.streams), against a real HLS
stream served over HTTP on 127.0.0.1 (written here with PyAV, served by Python's HTTP server): segments
of the configured length cut at keyframes without re-encoding, every frame exactly once, renamed into
the volume when whole; a camera whose URL is wrong never stops the others."""

import functools
import http.server
import os
import re
import signal
import threading
import time

import av
import numpy as np
import pytest

from resources.volume import VideoVolume
from tests.fixtures.batches import materialize_slice
from video_assets.core.streams.config import Camera, load_cameras, redacted
from video_assets.core.streams.recorder import CUT, ENDED, FIRST, Recorder, record_all

RATE, FRAMES, GOP = 10, 120, 10  # 12 s, a keyframe every second


def _frames(path_or_url: str) -> list[np.ndarray]:
    with av.open(path_or_url) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]


def _write_panning_clip(path, frames: int, seed: int, format=None, options=None):
    """An H.264 clip (a keyframe every GOP frames, no B-frames) panning over noise, as MP4 or ``format``."""
    tex = np.random.default_rng(seed).integers(0, 255, (96, 160 + 2 * frames, 3), dtype=np.uint8)
    with av.open(str(path), "w", format=format, options=options or {}) as out:
        s = out.add_stream("libx264", rate=RATE, options={"g": str(GOP), "bf": "0", "sc_threshold": "0"})
        s.width, s.height, s.pix_fmt = 160, 96, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(tex[:, i * 2 : i * 2 + 160]), format="rgb24")
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


@pytest.fixture(scope="module")
def hls(tmp_path_factory):
    root = tmp_path_factory.mktemp("hls")
    options = {"hls_time": "2", "hls_list_size": "0", "hls_segment_type": "mpegts"}
    _write_panning_clip(root / "live.m3u8", FRAMES, seed=5, format="hls", options=options)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/live.m3u8"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_cameras_are_configuration_and_a_bad_entry_names_its_camera(tmp_path, monkeypatch):
    good = tmp_path / "cameras.toml"
    good.write_text(
        '[[camera]]\nname = "dock-1"\nurl = "rtsp://10.0.0.5:554/s1"\nusername_env = "DOCK_USER"\n'
        'password_env = "DOCK_PASSWORD"\n\n[[camera]]\nname = "gate"\nurl = "https://cams.example/gate/index.m3u8?token=t0p"\n'
        "segment_s = 10\n"
    )
    dock, gate = load_cameras(good)
    assert (dock.segment_s, gate.segment_s) == (30.0, 10.0)
    assert (gate.allowed_hosts, gate.max_playlist_bytes) == ((), 1 << 20)  # a playlist's own host, 1 MiB
    monkeypatch.setenv("DOCK_USER", "ops")
    monkeypatch.setenv("DOCK_PASSWORD", "s3cr3t/!")
    assert dock.open_url(os.environ) == "rtsp://ops:s3cr3t%2F%21@10.0.0.5:554/s1"  # only for the demuxer
    assert dock.open_url({}) == "rtsp://10.0.0.5:554/s1"
    assert "s3cr3t" not in dock.redacted and "token" not in gate.redacted  # what logs and tables show
    assert redacted("rtsp://u:p@h:1/x?k=v") == "rtsp://h:1/x"
    for body, why in [
        ('[[camera]]\nname = "a"\nurl = "rtsp://user:pw@h/x"\n', "camera 'a'.*username_env"),
        ('[[camera]]\nname = "b"\nurl = "ftp://h/x"\n', "camera 'b'.*unsupported scheme"),
        ('[[camera]]\nname = "c"\nurl = "http://h/x.mp4"\n', "camera 'c'.*m3u8"),
        ('[[camera]]\nname = "d"\nurl = "/dev/video0"\nsegment_s = 0\n', "camera 'd'.*segment_s"),
        ('[[camera]]\nname = "e"\nurl = "/dev/video0"\ncolour = "red"\n', "camera 'e'.*colour"),
        ('[[camera]]\nname = "bad name!"\nurl = "/dev/video0"\n', r"camera 'bad\?name\?'.*name"),
        ('[[camera]]\nname = "f"\nurl = "/a"\n[[camera]]\nname = "f"\nurl = "/b"\n', "camera 'f'.*twice"),
        ('[[camera]]\nname = "g"\nurl = "http://h/x.m3u8"\nallowed_hosts = ["cdn a"]\n', "camera 'g'.*host:port"),
        ('[[camera]]\nname = "h"\nurl = "http://h/x.m3u8"\nmax_playlist_bytes = 1e9\n', "camera 'h'.*max_playlist"),
        ("[[camera]]\nurl = 3\n", "camera '#1'"),
        ("cameras = 1\n", "unknown top-level"),
        ("not toml [", "not TOML"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(body)
        with pytest.raises(ValueError, match=why):
            load_cameras(bad)


def test_the_recorder_cuts_at_keyframes_and_loses_or_repeats_no_frame(hls, tmp_path):
    rows = []
    camera = Camera(name="lab", url=hls, segment_s=3)
    recorder = Recorder(camera, tmp_path / "streams" / "lab", rows.append)
    recorder.record(max_connects=1)  # the playlist ends: one connection, then done
    files = sorted((tmp_path / "streams" / "lab").iterdir())
    assert [f.suffix for f in files] == [".mp4"] * 4 and not any(f.name.startswith(".") for f in files)
    # Cut at the first keyframe at or after 3 s: 30 frames each (one GOP is 1 s), the stream's end last.
    assert [r["frames"] for r in rows] == [30, 30, 30, 30]
    assert [r["duration_s"] for r in rows] == pytest.approx([3.0, 3.0, 3.0, 3.0])
    assert [r["reason"] for r in rows] == [FIRST, CUT, CUT, CUT]
    assert [r["uri"] for r in rows] == [str(f) for f in files]
    # Contiguous in time, and no frame lost or repeated across a cut: the segments decode to the source.
    assert rows[0]["gap_before_s"] is None and [r["gap_before_s"] for r in rows[1:]] == [0.0, 0.0, 0.0]
    assert all(a["ended_at"] == b["started_at"] for a, b in zip(rows, rows[1:]))
    recorded = [f for path in files for f in _frames(str(path))]
    source = _frames(hls)
    assert len(recorded) == len(source) == FRAMES
    assert all(np.array_equal(a, b) for a, b in zip(recorded, source))  # remuxed, never re-encoded
    with av.open(str(files[1])) as c:  # each file starts at 0 and on a keyframe
        first = next(c.demux(c.streams.video[0]))
        assert first.is_keyframe and first.pts == 0


def test_a_camera_with_a_wrong_url_never_stops_the_others(hls, tmp_path):
    rows = []
    cameras = [
        Camera(name="good", url=hls, segment_s=5),
        Camera(name="wrong", url=hls.rsplit("/", 1)[0] + "/none.m3u8", stall_s=2),
    ]
    folders = VideoVolume(uri=str(tmp_path)).stream_folder
    recorders = record_all(cameras, folders, rows.append, threading.Event(), max_connects=2)
    by_name = {r.camera.name: r for r in recorders}
    # The playlist ends, the recorder connects again after a backoff and records it again: a gap row says so.
    assert by_name["good"].segments == 6 and sum(r["frames"] for r in rows) == 2 * FRAMES
    assert [r["reason"] for r in rows] == [FIRST, CUT, CUT, ENDED, CUT, CUT]
    assert rows[3]["gap_before_s"] >= 0 and rows[3]["started_at"] >= rows[2]["ended_at"]
    assert by_name["wrong"].segments == 0 and by_name["wrong"].connects == 2
    assert {r["camera"] for r in rows} == {"good"}
    assert not (tmp_path / "streams" / "wrong").exists() or not any((tmp_path / "streams" / "wrong").iterdir())


@pytest.mark.slow
def test_video_assets_record_writes_segments_the_volume_registers(hls, tmp_path, monkeypatch):
    import subprocess
    import sys

    import polars as pl

    from resources.delta import DeltaTables
    from tests.fixtures.samples import REPO
    from video_assets.defs.ingest.registration import register_new_files

    volume, tables = tmp_path / "volume", tmp_path / "tables"
    volume.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "VIDEO_VOLUME_URI": str(volume)}
    env |= {"VIDEO_TABLES_URI": str(tables), "PYTHONPATH": str(REPO), "CAM_PASSWORD": "hunter2"}
    (tmp_path / "home").mkdir()
    config = tmp_path / "cams.toml"
    config.write_text(f'[[camera]]\nname = "lab"\nurl = "{hls}"\nsegment_s = 3\npassword_env = "CAM_PASSWORD"\n')
    cli = [sys.executable, "-m", "video_assets.cli"]
    done = subprocess.run([*cli, "record", "--config", str(config), "--seconds", "4"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hunter2" not in done.stdout + done.stderr
    files = sorted((volume / "streams" / "lab").iterdir())
    assert len(files) >= 4 and not any(f.name.startswith(".") for f in files)
    rows = pl.read_delta(str(tables / "stream_segments")).sort("started_at")
    assert sorted(rows["uri"]) == [str(f) for f in files] and set(rows["camera"]) == {"lab"}
    assert rows["frames"][:4].to_list() == [30, 30, 30, 30] and "hunter2" not in str(rows.to_dicts())
    assert "not reported" not in done.stderr
    # Each segment is a materialisation of stream_segments on the recorder's instance (a table of the graph).
    from dagster import AssetKey, DagsterInstance

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    with DagsterInstance.get() as instance:
        records = instance.fetch_materializations(AssetKey("stream_segments"), limit=1000).records
    assert sorted(r.asset_materialization.metadata["uri"].value for r in records) == sorted(rows["uri"])
    # The upload sensor's registration sees every finished segment (the same bytes twice: a duplicate).
    plan = register_new_files(VideoVolume(uri=str(volume)), DeltaTables(root_uri=str(tables)))
    manifest = pl.read_delta(str(tables / "batch_manifest"))
    assert manifest.height == len(files) and plan.batches
    # In the background, known by its pid file: one per instance, stopped by pid (each segment finished).
    import psutil

    def cli_run(*args):
        return subprocess.run([*cli, "record", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)

    for f in files:
        f.unlink()
    started = cli_run("--config", str(config), "--detach")
    assert started.returncode == 0, started.stderr[-2000:]
    pid = int(started.stdout.split("pid ")[1].split(")")[0])
    try:
        assert psutil.pid_exists(pid) and "recorder running (pid" in cli_run("--status").stdout
        again = cli_run("--config", str(config), "--detach")
        assert again.returncode == 2 and f"already recording (pid {pid})" in again.stderr
        deadline = time.monotonic() + 60
        while not any(p.suffix == ".mp4" for p in (volume / "streams" / "lab").iterdir()):
            assert time.monotonic() < deadline, "no segment from the background recorder"
            time.sleep(0.5)
        stopped = cli_run("--stop")
        assert stopped.returncode == 0 and f"recorder stopped (pid {pid})" in stopped.stdout
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
    assert not (tmp_path / "home" / "streams" / "recorder.json").exists()
    assert cli_run("--status").stdout.strip() == "no recorder running"
    assert not any(p.name.endswith(".part") for p in (volume / "streams" / "lab").iterdir())
    log = (tmp_path / "home" / "streams" / "recorder.log").read_text()
    assert "recorder stopped" in log and "hunter2" not in log
    # A bad entry is refused before anything starts, naming the camera.
    config.write_text('[[camera]]\nname = "lab"\nurl = "ftp://x/y"\n')
    bad = subprocess.run([*cli, "record", "--config", str(config)], env=env, cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "camera 'lab'" in bad.stderr


@pytest.mark.slow
def test_a_cameras_segments_flow_through_the_graph_into_alerts_in_its_own_time(
    hls, instance, resources, session_ray, volume_dir, tmp_path
):
    """Recorded segments -> stream_sensor's micro-batch -> captions (an OpenAI-compatible VLM endpoint, the
    project's stub server) -> structured events -> alerts placed in the camera's time, with how long after
    the moment each was raised."""
    import json
    from datetime import UTC, datetime, timedelta

    import polars as pl
    from dagster import build_sensor_context, materialize

    from tests.fixtures.batches import endpoint_resources
    from tests.fixtures.openai_stub import stub_server
    from video_assets.cli import segment_writer
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.ingest.assets import raw_videos, video_metadata
    from video_assets.defs.ingest.sensors import stream_sensor
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.routing.assets import routed_events
    from video_assets.defs.structuring.assets import structured_events

    event = {"start_s": 1.0, "end_s": 2.0, "actor": "person", "action": "picks up", "object": "box"}
    good = {"verdict": "confirmed", "confidence": 0.9, "events": [event], "rationale": "a box is picked up"}
    replies = {"model": "stub-vlm", "user_routes": {"Frames sampled at": "A person picks up a box."}}
    replies["routes"] = {"one JSON object": json.dumps(good)}
    recording = datetime.now(UTC)
    Recorder(Camera(name="lab", url=hls, segment_s=3), resources["volume"].stream_folder("lab"),
             segment_writer(resources["tables"])).record(max_connects=1)  # fmt: skip
    with stub_server(replies, tmp_path) as stub:
        res = endpoint_resources({**resources, **session_ray}, tmp_path, stub)
        sensor_resources = {k: res[k] for k in ("volume", "tables")}
        tick = stream_sensor(build_sensor_context(instance=instance, resources=sensor_resources))
        for req in tick.dynamic_partitions_requests:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        [run] = tick.run_requests
        assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
        # Two runs (captions, then the rest): in one process each Ray stage would initialise Ray again.
        sampling = {"ops": {"captions": {"config": {"max_frames": 3, "min_frames": 2}}}}
        for selection, config in (
            ([raw_videos, video_metadata, captions], sampling),
            ([structured_events, routed_events], {}),
        ):
            result = materialize_slice(
                selection, run.partition_key, instance=instance, resources=res, run_config=config
            )
            assert result.success
    done = datetime.now(UTC)
    segments = pl.read_delta(res["tables"].table_uri("stream_segments")).sort("started_at")
    alerts = pl.read_delta(res["tables"].table_uri("alerts")).sort("wall_start")
    assert segments.height == 4 and alerts["uri"].to_list() == segments["uri"].to_list()  # every segment
    assert set(alerts["camera"]) == {"lab"} and set(alerts["verdict"]) == {"confirmed"}
    for a, s in zip(alerts.to_dicts(), segments.to_dicts()):
        assert a["wall_start"] == s["started_at"] + timedelta(seconds=1) and a["wall_end"] == s[
            "started_at"
        ] + timedelta(seconds=2)
        # From the moment to the row, within the test's own time. (This playlist is read faster than real time,
        # so the later segments' stream clock runs ahead of the wall clock: only the first is surely before.)
        assert a["detected_after_s"] == pytest.approx((a["routed_at"] - a["wall_start"]).total_seconds(), abs=1e-3)
        assert a["detected_after_s"] <= (done - recording).total_seconds()
    assert alerts["detected_after_s"][0] > 0  # the first segment starts at the wall clock of its first packet
    meta = result.asset_materializations_for_node("routed_events")
    assert any("camera_median_detected_after_s" in m.metadata for m in meta)


# -- a real RTSP server (GStreamer's, tests/fixtures/rtsp_server.py) ----------------------------------------

RTSP_FRAMES = 80  # 8 s at 10 fps, a keyframe a second: the server sends it at its own pace


def _rtsp_available() -> bool:
    import subprocess

    probe = "import gi; gi.require_version('GstRtspServer', '1.0'); from gi.repository import GstRtspServer"
    try:
        return subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def rtsp_clip(tmp_path_factory):
    if not _rtsp_available():
        why = "no GStreamer RTSP server: apt-get install gir1.2-gst-rtsp-server-1.0 python3-gi gstreamer1.0-plugins-good gstreamer1.0-plugins-bad (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return _write_panning_clip(tmp_path_factory.mktemp("rtsp") / "clip.mp4", RTSP_FRAMES, seed=9)


def _serve_rtsp(clip, port: int):
    import subprocess

    from tests.fixtures.samples import REPO

    script = REPO / "tests" / "fixtures" / "rtsp_server.py"
    proc = subprocess.Popen(
        ["/usr/bin/python3", str(script), "--port", str(port), "--file", str(clip)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "ready", "the RTSP server did not start"
    return proc


@pytest.mark.slow
def test_an_rtsp_camera_started_late_and_killed_mid_stream_is_recorded_with_its_gaps(rtsp_clip, tmp_path):
    from tests.fixtures.processes import free_port, stop

    port, rows = free_port(), []
    camera = Camera(name="dock", url=f"rtsp://127.0.0.1:{port}/cam", segment_s=2, stall_s=3)
    halt = threading.Event()
    recorder = Recorder(camera, tmp_path / "streams" / "dock", rows.append, halt, max_backoff_s=2)
    thread = threading.Thread(target=recorder.record, daemon=True)
    thread.start()  # before the server: the recorder waits for it
    try:
        halt.wait(2)
        server = _serve_rtsp(rtsp_clip, port)
        # The first connection: about 4 s of the clip, then the server is killed mid-stream and restarted.
        deadline = time.monotonic() + 60
        while len(rows) < 2 and time.monotonic() < deadline:
            halt.wait(0.2)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        server = _serve_rtsp(rtsp_clip, port)
        while not any(r["reason"].startswith("reconnect") or r["reason"] == ENDED for r in rows[2:]):
            assert time.monotonic() < deadline, rows
            halt.wait(0.2)
        while len([r for r in rows if r["started_at"] >= rows[2]["started_at"]]) < 2:
            assert time.monotonic() < deadline, rows
            halt.wait(0.2)
    finally:
        halt.set()
        thread.join(timeout=30)
        stop(server)
    assert recorder.connects >= 3  # refused before the server was up, then the two servers
    assert rows[0]["reason"] == FIRST and rows[1]["reason"] == CUT
    # After the kill: the segment cut short is kept, the next says why the stream stopped, and when.
    resumed = next(i for i, r in enumerate(rows) if i >= 2 and r["reason"] not in (CUT,))
    assert rows[resumed]["reason"].startswith("reconnect") or rows[resumed]["reason"] == ENDED
    assert rows[resumed]["gap_before_s"] >= 0
    for r in rows[:-1]:  # each segment plays, starts on a keyframe, holds the frames its row says
        frames = _frames(r["uri"])
        assert len(frames) == r["frames"] > 0
    assert [r["frames"] for r in rows[:2]] == [20, 20]  # 2 s at 10 fps, cut at keyframes
    assert not any(p.name.startswith(".") for p in (tmp_path / "streams" / "dock").iterdir())


def test_a_stalled_or_garbage_stream_is_retried_never_a_crashed_recorder(tmp_path):
    import socket

    def serve(behaviour):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.settimeout(0.2)
        done = threading.Event()

        def loop():
            while not done.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                with conn:
                    behaviour(conn, done)

        threading.Thread(target=loop, daemon=True).start()
        return sock.getsockname()[1], done

    def garbage(conn, done):
        try:
            conn.sendall(np.random.default_rng(1).integers(0, 255, 65536, dtype=np.uint8).tobytes())
        except OSError:
            pass

    def stall(conn, done):
        done.wait(5)  # accepts, then says nothing

    ports = {name: serve(b) for name, b in (("garbage", garbage), ("stall", stall))}
    rows = []
    cameras = [Camera(name=n, url=f"rtsp://127.0.0.1:{p}/cam", stall_s=1) for n, (p, _) in ports.items()]
    started = time.monotonic()
    folders = VideoVolume(uri=str(tmp_path)).stream_folder
    recorders = record_all(cameras, folders, rows.append, threading.Event(), max_connects=2)
    for _, done in ports.values():
        done.set()
    assert [r.connects for r in recorders] == [2, 2] and rows == []
    assert time.monotonic() - started < 30  # the stall is cut by stall_s, not waited out


def _mpegts(width: int, height: int, frames: int, offset_s: float, shade: int) -> bytes:
    """An H.264 MPEG-TS stream in memory (a keyframe every GOP frames), timed from ``offset_s``."""
    import io

    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts", options={"output_ts_offset": str(offset_s)}) as out:
        s = out.add_stream("libx264", rate=RATE, options={"g": str(GOP), "bf": "0", "sc_threshold": "0"})
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), (shade + 3 * i) % 256, np.uint8), "rgb24")
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


@pytest.mark.timeout(120)
def test_a_resolution_change_starts_a_new_segment_on_a_new_connection(tmp_path):
    """A live source (a FIFO: a local device path) switches from 160x96 to 192x112 mid-stream, as an encoder
    reconfigured on the camera does. No segment mixes the two sizes (the demuxer keeps the first size's
    parameters: a stale header); the recorder connects again, and the new connection records the new size."""
    fifo = tmp_path / "camera.ts"
    os.mkfifo(fifo)
    small = _mpegts(160, 96, 40, 0, shade=10)
    large = _mpegts(192, 112, 40, 4, shade=140)

    def camera_side():  # what is live at each connection: first the switch, then the new size only
        import select

        for payload, live in ((small + large, True), (large, False)):
            try:
                with open(fifo, "wb") as f:  # blocks until the recorder opens it
                    f.write(payload)
                    f.flush()
                    poll = select.poll()
                    poll.register(f, select.POLLERR)
                    while live and not poll.poll(100):  # still live until the recorder hangs up (no reader)
                        pass
            except BrokenPipeError:  # it hung up after the switch, before everything was written
                pass

    writer = threading.Thread(target=camera_side, daemon=True)
    writer.start()
    rows = []
    recorder = Recorder(Camera(name="bay", url=str(fifo), segment_s=2), tmp_path / "bay", rows.append)
    try:
        recorder.record(max_connects=2)
    finally:  # a recorder still waiting to open the FIFO gets an end of stream instead of waiting forever
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    writer.join(timeout=10)
    sizes = []
    for row in rows:
        with av.open(row["uri"]) as c:
            frames = list(c.decode(c.streams.video[0]))
            assert {(f.width, f.height) for f in frames} == {(c.streams.video[0].width, c.streams.video[0].height)}
            sizes.append((frames[0].width, frames[0].height, len(frames)))
    assert sizes == [(160, 96, 20), (160, 96, 20), (192, 112, 20), (192, 112, 20)]
    assert "the picture changed from 160x96 to 192x112" in rows[2]["reason"]
    assert rows[2]["gap_before_s"] is not None and rows[3]["reason"] == CUT
    assert recorder.connects == 2


def test_retention_deletes_old_segments_but_keeps_the_evidence(tmp_path, capsys):
    from datetime import UTC, datetime, timedelta

    import polars as pl

    from resources.delta import DeltaTables
    from video_assets.cli import release, retention
    from video_assets.core.tables import ALERTS, KEYS, REVIEW_LABELS, STREAM_SEGMENTS, to_arrow

    now = datetime(2026, 12, 6, tzinfo=UTC)
    folder = tmp_path / "volume" / "streams" / "dock"
    folder.mkdir(parents=True)
    tables, volume = DeltaTables(root_uri=str(tmp_path / "tables")), VideoVolume(uri=str(tmp_path / "volume"))
    rows = []
    for name, age_days in [("old", 10), ("old_alert", 10), ("old_label", 9), ("new", 1)]:
        path = folder / f"{name}.mp4"
        path.write_bytes(b"segment " + name.encode())
        end = now - timedelta(days=age_days)
        rows.append(
            {"uri": str(path), "camera": "dock", "source": "rtsp://h/s", "started_at": end - timedelta(seconds=30)}
            | {"ended_at": end, "duration_s": 30.0, "frames": 300, "gap_before_s": 0.0, "reason": "cut"}
            | {"recorded_at": end}
        )
    tables.merge(STREAM_SEGMENTS, to_arrow(STREAM_SEGMENTS, rows), KEYS[STREAM_SEGMENTS])
    key = {"segment": 0, "use_case": "object_handling", "model_version": "1", "prompt_version": 1}
    key |= {"use_case_version": "u", "structurer": "s"}
    alert = {**key, "video_id": "a", "batch_key": "b", "uri": str(folder / "old_alert.mp4"), "reason": "r"}
    alert |= {"threshold": 0.7, "routed_at": now}
    tables.merge(ALERTS, to_arrow(ALERTS, [alert]), KEYS[ALERTS])
    label = {
        **key,
        "label_id": "label-0001",
        "item_id": "0" * 16,
        "video_id": "b",
        "uri": str(folder / "old_label.mp4"),
    }
    label |= {"decision": "confirmed", "reviewer": "ann", "labelled_at": now}
    tables.merge(REVIEW_LABELS, to_arrow(REVIEW_LABELS, [label]), KEYS[REVIEW_LABELS])

    assert retention(tables, volume, 7, True, now) == 0  # the dry run deletes nothing
    out = capsys.readouterr().out
    assert "would delete" in out and "old.mp4" in out and "1 segment(s) would be deleted, 2 kept" in out
    assert len(list(folder.iterdir())) == 4
    assert retention(tables, volume, 7, False, now) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["new.mp4", "old_alert.mp4", "old_label.mp4"]
    marked = pl.read_delta(str(tmp_path / "tables" / "stream_segments")).filter(pl.col("deleted_at").is_not_null())
    assert marked["uri"].to_list() == [str(folder / "old.mp4")]
    assert retention(tables, volume, 7, False, now) == 0 and "0 segment(s) deleted" in capsys.readouterr().out
    assert retention(tables, volume, 0, True, now) == 2  # a bad setting, said so
    # Evidence released by a person goes at the next retention; an unknown file marks nothing.
    assert release(tables, [str(folder / "old_alert.mp4"), str(folder / "nope.mp4")], now) == 2
    assert "nope.mp4" in capsys.readouterr().err
    assert release(tables, [str(folder / "old_alert.mp4")], now) == 0
    assert retention(tables, volume, 7, False, now) == 0
    assert "1 segment(s) deleted, 1 kept" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["new.mp4", "old_label.mp4"]


# -- cameras that fail say so: the status, the log, a health row; HLS hosts and playlist bytes bounded ---------


def _listen(behaviour) -> tuple[int, threading.Event]:
    """A TCP listener on 127.0.0.1 running ``behaviour(conn, done)`` for each connection, until ``done``."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)
    done = threading.Event()

    def serve(conn):
        with conn:
            behaviour(conn, done)

    def loop():
        with sock:
            while not done.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return sock.getsockname()[1], done


def _endless_playlist(conn, done):
    """An HTTP answer whose playlist never ends, as fast as the socket takes it."""
    conn.recv(65536)
    entries = b"".join(b"#EXTINF:2.0,\nseg%d.ts\n" % i for i in range(4096))
    try:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.apple.mpegurl\r\nConnection: close\r\n\r\n")
        conn.sendall(b"#EXTM3U\n#EXT-X-TARGETDURATION:2\n")
        while not done.is_set():
            conn.sendall(entries)
    except OSError:  # the recorder hung up
        pass


# How much the recorder process may grow (its peak, VmHWM, over its size as it started the cameras) with the
# five cameras below: measured 9-40 MB here. The old recorder read the endless playlist for stall_s (10 s)
# each attempt: 555 -> 1514 MB in 40 s.
GROWTH_MB = 150


def _memory_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) / 1024


@pytest.mark.slow
def test_cameras_that_cannot_record_say_why_in_the_status_the_log_and_a_health_row(hls, tmp_path):
    """A refused playlist, an RTSP server that accepts and never answers, a port that is not HTTP and an
    endless playlist beside a good camera: ``record --status`` names each failing camera with its reason,
    the log has a warning per failed attempt, each camera has a ``camera_health`` row, and the recorder's
    memory grows by less than GROWTH_MB (an endless playlist is read up to ``max_playlist_bytes``)."""
    import subprocess
    import sys

    import polars as pl

    from tests.fixtures.processes import free_port
    from tests.fixtures.samples import REPO

    silent, silent_done = _listen(lambda conn, done: done.wait(60))
    banner, banner_done = _listen(lambda conn, done: conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n") or done.wait(60))
    endless, endless_done = _listen(_endless_playlist)
    volume, tables, home = tmp_path / "volume", tmp_path / "tables", tmp_path / "home"
    volume.mkdir()
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "VIDEO_VOLUME_URI": str(volume), "VIDEO_TABLES_URI": str(tables)}
    env |= {"PYTHONPATH": str(REPO), "CAM_PASSWORD": "hunter2"}
    config = tmp_path / "cams.toml"
    cameras = {
        "good": (hls, "segment_s = 60"),
        "refused": (f"http://127.0.0.1:{free_port()}/live.m3u8", 'password_env = "CAM_PASSWORD"'),
        "silent": (f"rtsp://127.0.0.1:{silent}/cam", "stall_s = 2"),
        "not-http": (f"http://127.0.0.1:{banner}/live.m3u8", "stall_s = 2"),
        # stall_s = 10: bounded by bytes, not by time (the old recorder read 10 s of it, then tried again)
        "endless": (f"http://127.0.0.1:{endless}/live.m3u8", 'stall_s = 10\npassword_env = "CAM_PASSWORD"'),
    }
    config.write_text(
        "".join(f'[[camera]]\nname = "{n}"\nurl = "{u}"\n{extra}\n\n' for n, (u, extra) in cameras.items())
    )
    cli = [sys.executable, "-m", "video_assets.cli", "record"]

    def cli_run(*args):
        return subprocess.run([*cli, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)

    started = cli_run("--config", str(config), "--detach")
    assert started.returncode == 0, started.stderr[-2000:]
    pid = int(started.stdout.split("pid ")[1].split(")")[0])
    start_mb = _memory_mb(pid, "VmRSS")  # the cameras have just started
    expected = {
        "refused": "Connection refused",
        "silent": "no answer within 2 s",
        "not-http": "BadStatusLine: SSH-2.0-OpenSSH_9.2",
        "endless": "playlists larger than max_playlist_bytes=1048576",
    }
    try:
        deadline, lines = time.monotonic() + 150, {}
        while True:  # each failing camera named with its reason, twice in a row (a retry); the good one recording
            status = cli_run("--status").stdout
            lines = dict(re.findall(r"^  ([\w-]+): (.*)$", status, re.M))
            failing = all(
                f"{name}: failing since" in f"{name}: {lines.get(name, '')}" and why in lines[name]
                and re.search(r"\b([2-9]|\d\d+) failed in a row", lines[name])
                for name, why in expected.items()
            )  # fmt: skip
            if failing and "last segment: /" in lines.get("good", ""):
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        peak_mb = _memory_mb(pid, "VmHWM")
    finally:
        cli_run("--stop")  # before the servers go: the last attempts fail as the ones before
        for done in (silent_done, banner_done, endless_done):
            done.set()
    assert lines["good"].startswith(("recording", "connecting")) and "failed in a row" not in lines["good"]
    assert peak_mb - start_mb < GROWTH_MB, f"the recorder grew from {start_mb:.0f} MB to {peak_mb:.0f} MB"
    # The health rows: one per camera, written as it stopped.
    health = {r["camera"]: r for r in pl.read_delta(str(tables / "camera_health")).to_dicts()}
    assert set(health) == set(cameras) and {r["status"] for r in health.values()} == {"stopped"}
    for name, why in expected.items():
        row = health[name]
        assert why in row["last_error"] and row["consecutive_failures"] >= 2 and row["last_segment"] is None, row
        assert row["source"] == cameras[name][0] and row["connects"] >= row["consecutive_failures"]
    assert health["good"]["last_segment"].startswith(str(volume / "streams" / "good"))
    # The log: a warning for each failed attempt, with its reason; never the password.
    log = (home / "streams" / "recorder.log").read_text()
    for name, why in expected.items():
        warned = [line for line in log.splitlines() if f" WARNING {name} (" in line]
        assert len(warned) >= 2 and all(why in line for line in warned), (name, warned)
    assert "hunter2" not in log + status + str(health)


def _serve_folder(root) -> tuple[str, http.server.ThreadingHTTPServer, list[str]]:
    """``root`` over HTTP on 127.0.0.1 (a 302 for ``/moved/<path>`` to ``$REDIRECT/<path>``); the paths asked."""
    asked = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(root), **k)

        def log_message(self, *a):
            pass

        def do_GET(self):
            asked.append(self.path)
            if self.path.startswith("/moved/"):
                self.send_response(302)
                self.send_header("Location", (root / "REDIRECT").read_text() + self.path.removeprefix("/moved"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server, asked


def test_a_playlist_sends_the_recorder_only_to_its_own_host_unless_allowed(tmp_path):
    """Segments named on another host and port than the playlist's, or a redirect there, are refused (naming
    the host) and never asked for; ``allowed_hosts`` lets them in."""
    from urllib.parse import urlsplit

    other_root, home_root = tmp_path / "other", tmp_path / "home"
    other_root.mkdir()
    home_root.mkdir()
    other, other_server, other_asked = _serve_folder(other_root)
    home, home_server, home_asked = _serve_folder(home_root)
    try:
        options = {"hls_time": "2", "hls_list_size": "0", "hls_segment_type": "mpegts"}
        source = _write_panning_clip(other_root / "live.m3u8", FRAMES, seed=5, format="hls", options=options)
        # home's playlist names each segment on other (another port: another service)
        lines = source.read_text().splitlines()
        (home_root / "live.m3u8").write_text("\n".join(f"{other}/{x}" if x.endswith(".ts") else x for x in lines))
        (home_root / "REDIRECT").write_text(other)
        host = urlsplit(other).netloc
        for url in (f"{home}/live.m3u8", f"{home}/moved/live.m3u8"):  # the second: a 302 to other's playlist
            health = []
            camera = Camera(name="lab", url=url, segment_s=60)
            recorder = Recorder(camera, tmp_path / "refused", lambda row: None, on_health=health.append)
            recorder.record(max_connects=1)
            assert recorder.segments == 0 and other_asked == [], url
            assert health[-1]["consecutive_failures"] == 1 and health[-1]["status"] == "stopped"
            assert f"{host} is not the playlist's host" in health[-1]["last_error"], health[-1]
        assert home_asked == ["/live.m3u8", "/moved/live.m3u8"]
        rows = []
        allowed = Camera(name="lab", url=f"{home}/live.m3u8", segment_s=60, allowed_hosts=[host])
        Recorder(allowed, tmp_path / "allowed", rows.append).record(max_connects=1)
        assert [r["frames"] for r in rows] == [FRAMES] and other_asked == [f"/live{i}.ts" for i in range(6)]
    finally:
        for server in (other_server, home_server):
            server.shutdown()
            server.server_close()
