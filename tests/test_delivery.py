"""Alert delivery: each alert posted once to each webhook (a real HTTP receiver on 127.0.0.1, real Delta
tables), retried with backoff while the receiver fails, the same Idempotency-Key on every try (so a receiver
drops the repeat after a sender that died before recording the answer); no secret in a payload or a row.
Hostile receivers (real sockets on 127.0.0.1): a redirect is not followed, a garbage answer is recorded,
a trickled answer is cut at the deadline, and a hung destination delays no other."""

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from dagster import SkipReason, build_sensor_context

from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from video_assets.core.delivery.webhooks import load_destinations
from video_assets.core.routing import wall_clock
from video_assets.core.tables import ALERT_DELIVERIES, ALERTS, KEYS, to_arrow
from video_assets.defs.delivery.sensors import alert_delivery_sensor, deliver_due

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


class Receiver(http.server.BaseHTTPRequestHandler):
    """Fails the first ``fail`` requests with 500; accepts once per Idempotency-Key."""

    def do_POST(self):
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["requests"].append({"body": body, "headers": dict(self.headers)})
        if len(state["requests"]) <= state["fail"]:
            self.send_response(500)
        else:
            state["accepted"].setdefault(self.headers["Idempotency-Key"], body)
            self.send_response(200)
        self.end_headers()
        self.wfile.flush()
        if state.get("kill_sender"):  # the sender dies the moment it has been answered, before it records it
            os.kill(state.pop("kill_sender"), signal.SIGKILL)

    def do_GET(self):  # what a followed redirect would send
        self.server.state["requests"].append({"method": "GET", "headers": dict(self.headers)})
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """Starts HTTP servers on 127.0.0.1 (``serve(handler, **state)``), stopped after the test."""
    started = []

    def start(handler=Receiver, **state) -> http.server.ThreadingHTTPServer:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.state = {"requests": [], "accepted": {}, "fail": 0, **state}
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@pytest.fixture
def receiver(serve):
    return serve()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/hook"


def _alert(video: str, uri: str) -> dict:
    return {
        "video_id": video, "segment": 0, "use_case": "object_handling", "model_version": "1", "prompt_version": 1,
        "use_case_version": "u1", "structurer": "s", "batch_key": "b1", "uri": uri, "caption_digest": "d",
        "start_s": 4.0, "end_s": 6.5, "verdict": "confirmed", "confidence": 0.9, "events": [],
        "reason": "confirmed with confidence 0.90 >= 0.70", "excerpt": "a person lifts a box", "threshold": 0.7,
        "routed_at": T0,
    }  # fmt: skip


def _camera_alert(tmp_path, segment: int = 0) -> dict:
    uri = str(tmp_path / "volume" / "streams" / "dock" / f"20261206T12000{segment}.000Z.mp4")
    alert = _alert("v" * 64, uri) | {"segment": segment}
    return alert | wall_clock(alert, {"camera": "dock", "started_at": T0}, T0 + timedelta(seconds=20))


def _setup_many(tmp_path, urls: dict[str, str], alerts: int, timeout_s: float) -> tuple[DeltaTables, AlertDestinations]:
    """``alerts`` alerts and one json destination per (name, url), in that order, each with OPS_TOKEN."""
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    rows = [_camera_alert(tmp_path, i) for i in range(alerts)]
    tables.merge(ALERTS, to_arrow(ALERTS, rows), KEYS[ALERTS])
    config = tmp_path / "destinations.toml"
    config.write_text(
        "".join(f'[[destination]]\nname = "{n}"\nurl = "{u}"\ntoken_env = "OPS_TOKEN"\n' for n, u in urls.items())
    )
    return tables, AlertDestinations(config_file=str(config), timeout_s=timeout_s)


def _rows(tables: DeltaTables, destination: str) -> list[dict]:
    return [r for r in tables.read(ALERT_DELIVERIES).to_dicts() if r["destination"] == destination]


def _setup(tmp_path, url: str, fmt: str = "json") -> tuple[DeltaTables, AlertDestinations]:
    tables = DeltaTables(root_uri=str(tmp_path / "tables"))
    uri = str(tmp_path / "volume" / "streams" / "dock" / "20261206T120000.000Z.mp4")
    # A camera's alert, as routing writes it: in the camera's time (the segment began at T0).
    alert = _alert("v" * 64, uri)
    alert |= wall_clock(alert, {"camera": "dock", "started_at": T0}, T0 + timedelta(seconds=20))
    tables.merge(ALERTS, to_arrow(ALERTS, [alert]), KEYS[ALERTS])
    config = tmp_path / "destinations.toml"
    config.write_text(f'[[destination]]\nname = "ops"\nurl = "{url}"\nformat = "{fmt}"\ntoken_env = "OPS_TOKEN"\n')
    return tables, AlertDestinations(config_file=str(config))


def test_an_alert_is_retried_until_accepted_and_sent_once(tmp_path, receiver, monkeypatch):
    monkeypatch.setenv("OPS_TOKEN", "s3cret-token")
    receiver.state["fail"] = 2
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    tables, delivery = _setup(tmp_path, url)
    ticks = [
        T0,
        T0 + timedelta(seconds=1),
        T0 + timedelta(seconds=11),
        T0 + timedelta(seconds=40),
        T0 + timedelta(hours=2),
    ]
    counts = [deliver_due(tables, delivery, now) for now in ticks]
    assert [(c["sent"], c["retrying"]) for c in counts] == [(0, 1), (0, 0), (0, 1), (1, 0), (0, 0)]
    requests = receiver.state["requests"]
    assert len(requests) == 3 and len({r["headers"]["Idempotency-Key"] for r in requests}) == 1
    assert len(receiver.state["accepted"]) == 1
    [row] = tables.read(ALERT_DELIVERIES).to_dicts()
    assert (row["status"], row["attempts"], row["http_status"]) == ("sent", 3, 200)
    # The payload: what happened, on which camera, when by the camera's clock, and a link to the clip.
    body = requests[-1]["body"]
    assert (body["camera"], body["verdict"], body["confidence"]) == ("dock", "confirmed", 0.9)
    assert body["wall_clock"] == {"start": "2026-12-06T12:00:04+00:00", "end": "2026-12-06T12:00:06.500000+00:00"}
    assert body["clip"].endswith(f"/api/videos/{'v' * 64}/file#t=4,6.5") and body["excerpt"]
    # The token goes in the header only: not in a payload, a row, or the source URL.
    assert requests[-1]["headers"]["Authorization"] == "Bearer s3cret-token"
    assert "s3cret" not in json.dumps([r["body"] for r in requests]) and "s3cret" not in str(row)


SENDER = """
import sys
from datetime import datetime
from resources.delivery import AlertDestinations
from resources.delta import DeltaTables
from video_assets.defs.delivery.sensors import deliver_due
deliver_due(DeltaTables(root_uri=sys.argv[1]), AlertDestinations(config_file=sys.argv[2]), datetime.fromisoformat(sys.argv[3]))
print("recorded")
"""


def test_a_sender_killed_after_the_answer_repeats_the_same_key(tmp_path, receiver):
    from tests.fixtures.samples import REPO

    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    tables, delivery = _setup(tmp_path, url, fmt="slack")
    # A real process, SIGKILLed by the receiver right after its 200 went out: the answer is never recorded.
    command = [sys.executable, "-c", SENDER, str(tmp_path / "tables"), delivery.config_file, T0.isoformat()]
    sender = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    receiver.state["kill_sender"] = sender.pid
    out, err = sender.communicate(timeout=180)
    assert sender.returncode == -signal.SIGKILL, err[-2000:]
    assert "recorded" not in out and len(receiver.state["accepted"]) == 1
    assert not tables.exists(ALERT_DELIVERIES)  # nothing recorded: the next tick sends again...
    assert deliver_due(tables, delivery, T0 + timedelta(seconds=1))["sent"] == 1
    keys = [r["headers"]["Idempotency-Key"] for r in receiver.state["requests"]]
    assert len(keys) == 2 and len(set(keys)) == 1 and len(receiver.state["accepted"]) == 1  # ...with the same key
    text = receiver.state["requests"][0]["body"]["text"]  # a Slack incoming-webhook body
    assert "dock" in text and "confirmed" in text and "play the clip" in text
    assert deliver_due(tables, delivery, T0 + timedelta(hours=1))["due"] == 0


def test_the_sensor_delivers_and_bad_destinations_name_the_setting(tmp_path, receiver):
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    tables, delivery = _setup(tmp_path, url)
    result = alert_delivery_sensor(build_sensor_context(resources={"tables": tables, "alert_delivery": delivery}))
    # The rows it wrote are reported as a materialisation of alert_deliveries (a table of the graph).
    [event] = result.asset_events
    assert event.asset_key.to_user_string() == "alert_deliveries"
    assert event.metadata["rows"].value == 1 and event.metadata["sent"].value == 1
    assert len(receiver.state["accepted"]) == 1
    again = alert_delivery_sensor(build_sensor_context(resources={"tables": tables, "alert_delivery": delivery}))
    assert isinstance(again, SkipReason) and again.skip_message == "no alert to deliver"  # nothing written: no event
    assert deliver_due(tables, AlertDestinations())["due"] == 0  # none configured: nothing sent
    bad = tmp_path / "bad.toml"
    for text, why in [
        ('[[destination]]\nname = "x"\nurl = "ftp://h/x"\n', "destination 'x'.*http"),
        ('[[destination]]\nname = "y"\nurl = "https://u:p@h/x"\n', "destination 'y'.*token_env"),
        ('[[destination]]\nname = "z"\nurl = "https://h/x"\nformat = "xml"\n', "destination 'z'.*format"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            load_destinations(bad)
    with pytest.raises(ValueError, match="VIDEO_ALERT_DESTINATIONS"):
        AlertDestinations(config_file=str(bad)).destinations()


@pytest.fixture
def raw_server():
    """Starts TCP listeners on 127.0.0.1 that are not HTTP servers: ``raw_server(answer)`` calls
    ``answer(conn, stop)`` for each connection (in its own thread) once the request has been read."""
    stop, listeners = threading.Event(), []

    def start(answer) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def handle(conn):
            with conn, conn.makefile("rb") as request:  # the whole request read: a close is not a reset
                length = 0
                while (line := request.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request.read(length)
                try:
                    answer(conn, stop)
                except OSError:  # the client hung up
                    pass

        def accept():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}/hook"

    yield start
    stop.set()
    for listener in listeners:
        listener.close()


@pytest.mark.parametrize("code", [302, 303])
def test_a_redirect_is_not_followed_and_the_token_goes_nowhere_else(tmp_path, serve, monkeypatch, code):
    monkeypatch.setenv("OPS_TOKEN", "s3cret-token")
    elsewhere = serve()

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.server.state["requests"].append(dict(self.headers))
            self.send_response(code)
            self.send_header("Location", _url(elsewhere).replace("/hook", "/collect"))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirector = serve(Redirect)
    tables, delivery = _setup_many(tmp_path, {"ops": _url(redirector)}, alerts=1, timeout_s=10)
    counts = deliver_due(tables, delivery, T0)
    assert (counts["sent"], counts["retrying"]) == (0, 1)
    [row] = _rows(tables, "ops")
    assert (row["status"], row["http_status"]) == ("retrying", code)
    assert row["error"] == f"HTTP {code} redirect not followed"
    # The configured URL got the token; the place it pointed to got nothing at all.
    assert [r["Authorization"] for r in redirector.state["requests"]] == ["Bearer s3cret-token"]
    assert elsewhere.state["requests"] == []


def test_a_garbage_answer_is_recorded_and_the_next_tick_delivers_the_others(tmp_path, receiver, raw_server):
    garbage = raw_server(lambda conn, stop: conn.sendall(b"garbage\r\n\r\n"))
    hangup = raw_server(lambda conn, stop: None)  # reads the request, closes without a word
    urls = {"garbage": garbage, "hangup": hangup, "ops": _url(receiver)}
    tables, delivery = _setup_many(tmp_path, urls, alerts=2, timeout_s=10)
    counts = deliver_due(tables, delivery, T0)
    assert (counts["sent"], counts["retrying"], counts["left"]) == (2, 4, 0)
    assert {r["error"].split(":")[0] for r in _rows(tables, "garbage")} == {"BadStatusLine"}
    assert {r["error"].split(":")[0] for r in _rows(tables, "hangup")} == {"RemoteDisconnected"}
    assert {r["status"] for r in _rows(tables, "ops")} == {"sent"}
    # A new alert, the next tick: delivered to the healthy destination, the broken ones retried again.
    tables.merge(ALERTS, to_arrow(ALERTS, [_camera_alert(tmp_path, 2)]), KEYS[ALERTS])
    counts = deliver_due(tables, delivery, T0 + timedelta(seconds=11))
    assert (counts["sent"], counts["retrying"]) == (1, 6)
    assert len(receiver.state["accepted"]) == 3
    assert sorted(r["attempts"] for r in _rows(tables, "garbage")) == [1, 2, 2]


def test_a_trickled_answer_is_cut_at_the_total_deadline(tmp_path, raw_server):
    def trickle(conn, stop):  # a byte every 0.2 s for a minute: each read is quick, the answer never ends
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 300:
            if stop.wait(0.2):
                return
            conn.sendall(bytes([byte]))

    tables, delivery = _setup_many(tmp_path, {"slow": raw_server(trickle)}, alerts=3, timeout_s=1)
    started = time.monotonic()
    counts = deliver_due(tables, delivery, T0)
    # Generous: the deadline is 1 s, the trickle a minute; the bound only tells the two apart.
    assert time.monotonic() - started < 20
    # One request used the whole deadline: the other two wait for the next tick instead of a deadline each.
    assert (counts["sent"], counts["retrying"], counts["left"]) == (0, 1, 2)
    [row] = _rows(tables, "slow")
    assert row["status"] == "retrying" and row["error"] == "TimeoutError: no answer within 1 s"


def test_a_hung_destination_delays_no_other(tmp_path, serve, receiver):
    class Hung(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.server.state["requests"].append(dict(self.headers))
            self.server.state["release"].wait(300)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    hung = serve(Hung, release=threading.Event())
    # The hung destination first, and a deadline far longer than this test waits for the healthy one.
    urls = {"hung": _url(hung), "ops": _url(receiver)}
    tables, delivery = _setup_many(tmp_path, urls, alerts=3, timeout_s=120)
    result = {}
    tick = threading.Thread(target=lambda: result.update(deliver_due(tables, delivery, T0)), daemon=True)
    tick.start()
    try:
        waited = time.monotonic()
        while (len(receiver.state["accepted"]), len(hung.state["requests"])) != (3, 1):
            assert time.monotonic() - waited < 60, "the healthy destination waited for the hung one"
            time.sleep(0.1)
        assert tick.is_alive()  # the hung request still held: all this within the tick
    finally:
        hung.state["release"].set()
    tick.join(timeout=60)
    assert not tick.is_alive()
    assert (result["sent"], result["retrying"]) == (3, 3)  # all in this one tick
    assert {r["status"] for r in _rows(tables, "ops")} == {"sent"}
