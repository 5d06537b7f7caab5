"""The search service as a user runs it: `python -m video_assets.service` in a subprocess (uvicorn on a
free 127.0.0.1 port) over an index this test builds (real LanceDB, real MiniLM, real clips registered in
raw_videos), checked over HTTP, then in headless Chromium: type a query, see cards with loaded
thumbnails, click one, and the video plays from the hit's start. The server is stopped by its PID."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime

import pytest

from resources.archive import TEXT, assemble_packaged
from resources.delta import DeltaTables
from tests.fixtures.browser import launch, playwright_sync_api
from tests.fixtures.golden_index import golden
from tests.fixtures.processes import free_port, stop
from tests.fixtures.samples import REPO, copy_samples
from tests.test_search import caption_embeddings
from video_assets.core.embeddings.text import TextEncoder
from video_assets.core.search import index as ix
from video_assets.core.tables import RAW_VIDEOS, to_arrow

CLIPS = ["sam2_04_coffee.mp4", "fire2.mp4", "chaplin.mp4", "bottle-detection.mp4"]
START_S, END_S = 2.0, 6.0  # the captions' time range: a click must play from START_S
SCREENSHOTS = REPO / "artifacts" / "screenshots"

pytestmark = pytest.mark.slow


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    volume = root / "volume"
    paths = {p.name: p for p in copy_samples(volume, CLIPS)}
    model = assemble_packaged(TEXT, root / "minilm")
    clips = [{**c, "file": c["file"]} for c in golden() if c["file"] in CLIPS]
    texts = caption_embeddings(TextEncoder(model), clips).with_columns(
        start_s=ix.pl.lit(START_S), end_s=ix.pl.lit(END_S), uri=ix.pl.Series([str(paths[c["file"]]) for c in clips])
    )
    index_uri = str(root / "search_index")
    ix.write_batch(index_uri, "b1", {ix.TEXTS: ix.text_rows(texts)})
    tables = DeltaTables(root_uri=str(root / "tables"))
    now = datetime.now(UTC)
    raw = [
        {
            "video_id": c["sha256"],
            "uri": str(paths[c["file"]]),
            "size_bytes": paths[c["file"]].stat().st_size,
            "mtime": now,
            "batch_key": "b1",
            "registered_at": now,
        }
        for c in clips
    ]
    tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, raw), ["video_id"])
    port = free_port()
    log = open(root / "server.log", "w")
    cmd = [sys.executable, "-m", "video_assets.service", "--index", index_uri, "--text-model", str(model)]
    cmd += ["--tables", tables.root_uri, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                if get(f"{url}/openapi.json")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "service did not answer in 90 s"
            time.sleep(0.5)
        yield {"url": url, "clips": clips, "pid": proc.pid}
    finally:
        stop(proc, grace_s=20)
        log.close()
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)  # gone (reaped)


def test_missing_index_fails_fast_with_what_to_run(tmp_path):
    cmd = [sys.executable, "-m", "video_assets.service", "--index", str(tmp_path / "none"), "--text-model", "x"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "make demo" in done.stderr


def test_api(server):
    url = server["url"]
    status, _, body = get(f"{url}/api/search?q=someone+pours+coffee+into+a+mug&k=3")
    assert status == 200
    hits = json.loads(body)["hits"]
    assert hits[0]["uri"].endswith("sam2_04_coffee.mp4")
    assert all(h["thumbnail_url"] and h["start_s"] == START_S and h["end_s"] == END_S for h in hits)
    status, headers, jpeg = get(url + hits[0]["thumbnail_url"])
    assert status == 200 and headers["content-type"] == "image/jpeg" and jpeg[:3] == b"\xff\xd8\xff"
    vid = hits[0]["video_id"]
    status, headers, part = get(f"{url}/api/videos/{vid}/file", {"Range": "bytes=100-1099"})
    assert status == 206 and len(part) == 1000
    assert headers["content-range"].startswith("bytes 100-1099/") and headers["accept-ranges"] == "bytes"
    whole = get(f"{url}/api/videos/{vid}/file")
    assert whole[0] == 200 and whole[2][100:1100] == part
    assert json.loads(get(f"{url}/api/videos/{vid}")[2])["count"] == 1
    assert json.loads(get(f"{url}/api/window?video_id={vid}&start_s=0&end_s=3")[2])["count"] == 1
    assert json.loads(get(f"{url}/api/events?verdict=confirmed")[2])["count"] == 0
    for bad, code in [
        ("/api/search?q=", 422),
        ("/api/search?q=%20%20", 422),
        ("/api/search?q=dog&k=0", 422),
        ("/api/search?q=dog&k=500", 422),
        ("/api/search?q=dog&sources=nope", 422),
        ("/api/search?q=dog&offset=-1", 422),
        ("/api/search", 422),
        (f"/api/window?video_id={vid}&start_s=5&end_s=1", 422),
        ("/api/window?video_id=unknown&start_s=0&end_s=1", 404),
        ("/api/videos/unknown", 404),
        ("/api/videos/unknown/thumbnail?t=1", 404),
        ("/api/videos/..%2F..%2Fetc%2Fpasswd/file", 404),
        ("/api/frames/similar?video_id=unknown&t=1", 404),
        ("/api/events?min_confidence=2", 422),
    ]:
        status, _, body = get(url + bad)
        assert status == code, (bad, status, body)
        assert json.loads(body)["detail"], bad
    assert get(f"{url}/api/videos/{vid}/file", {"Range": "bytes=999999999-"})[0] == 416
    assert get(f"{url}/openapi.json")[0] == 200 and get(f"{url}/docs")[0] == 200
    assert get(f"{url}/")[0] == 200


@pytest.mark.browser
def test_browser_search_and_play(server):
    sync_api = playwright_sync_api()  # missing Chromium: a failure under CI, a skip elsewhere
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(server["url"] + "/")
            page.fill("#q", "a dog standing in a bathtub")
            page.press("#q", "Enter")
            page.wait_for_selector(".card")
            first = page.locator(".card").first
            sync_api.expect(first).to_contain_text("fire2.mp4")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.card img')].every(i => i.complete && i.naturalWidth > 0)",
                timeout=30000,
            )
            first.click()
            page.wait_for_function("() => document.getElementById('video').readyState >= 1", timeout=30000)
            page.wait_for_timeout(500)
            t = page.evaluate("() => document.getElementById('video').currentTime")
            assert START_S - 0.25 <= t <= END_S + 0.25, t
            sync_api.expect(page.locator("#now")).to_contain_text("fire2.mp4 00:02.0-00:06.0")
            # The ask box: no LLM is configured, so the agent's extractive answer, citing the clip; a
            # citation plays its clip.
            page.fill("#question", "Where is a dog standing in a bathtub?")
            page.press("#question", "Enter")
            sync_api.expect(page.locator("#answer")).to_contain_text("No language model is configured", timeout=30000)
            sync_api.expect(page.locator("#ask-status")).to_contain_text("Extractive answer")
            cited = page.locator("#citations a").first
            sync_api.expect(cited).to_contain_text("fire2.mp4")
            page.screenshot(path=str(SCREENSHOTS / "search.png"), full_page=True)
        finally:
            browser.close()
