"""Alert delivery: each alert posted once to each webhook (a real HTTP receiver on 127.0.0.1, real Delta
tables), retried with backoff while the receiver fails, the same Idempotency-Key on every try (so a receiver
drops the repeat after a sender that died before recording the answer); no secret in a payload or a row."""

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
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

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.state = {"requests": [], "accepted": {}, "fail": 0}
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=10)


def _alert(video: str, uri: str) -> dict:
    return {
        "video_id": video, "segment": 0, "use_case": "object_handling", "model_version": "1", "prompt_version": 1,
        "use_case_version": "u1", "structurer": "s", "batch_key": "b1", "uri": uri, "caption_digest": "d",
        "start_s": 4.0, "end_s": 6.5, "verdict": "confirmed", "confidence": 0.9, "events": [],
        "reason": "confirmed with confidence 0.90 >= 0.70", "excerpt": "a person lifts a box", "threshold": 0.7,
        "routed_at": T0,
    }  # fmt: skip


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
    assert isinstance(result, SkipReason) and "1 sent" in result.skip_message
    assert len(receiver.state["accepted"]) == 1
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
