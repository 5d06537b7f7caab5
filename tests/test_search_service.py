"""The search service as a user runs it: `python -m video_assets.service` in a subprocess (uvicorn on a
free 127.0.0.1 port) over an index this test builds (real LanceDB, real MiniLM, real clips registered in
raw_videos), checked over HTTP, then in headless Chromium: type a query, see cards with loaded
thumbnails, click one, and the video plays from the hit's start. The server is stopped by its PID."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from resources.archive import TEXT, assemble_packaged
from resources.delta import DeltaTables
from tests.fixtures.browser import launch, playwright_sync_api
from tests.fixtures.golden_index import golden
from tests.fixtures.processes import free_port, stop
from tests.fixtures.samples import REPO, copy_samples
from tests.test_search import caption_embeddings
from video_assets.core.embeddings.text import TextEncoder
from video_assets.core.routing import split
from video_assets.core.search import index as ix
from video_assets.core.tables import KEYS, RAW_VIDEOS, REVIEW_QUEUE, to_arrow

CLIPS = ["sam2_04_coffee.mp4", "fire2.mp4", "chaplin.mp4", "bottle-detection.mp4"]
START_S, END_S = 2.0, 6.0  # the captions' time range: a click must play from START_S
SCREENSHOTS = REPO / "artifacts" / "screenshots"
GONE_ID = "f" * 64  # a registered video whose file was deleted

ALSO_HOST = "archive.example.test"  # the name the service is served behind (VIDEO_SERVICE_ALLOWED_HOSTS)

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
    gone = copy_samples(root / "gone", ["realshort.mp4"])[0]  # registered, then deleted from the volume
    raw.append({**raw[0], "video_id": GONE_ID, "uri": str(gone), "size_bytes": gone.stat().st_size})
    gone.unlink()
    tables.merge(RAW_VIDEOS, to_arrow(RAW_VIDEOS, raw), ["video_id"])
    _review_queue(tables, {c["file"]: (c["sha256"], str(paths[c["file"]])) for c in clips}, now)
    from resources.settings import ensure_secret_file

    token_file = ensure_secret_file(root / "review" / "token")
    port = free_port()
    log = open(root / "server.log", "w")
    cmd = [sys.executable, "-m", "video_assets.service", "--index", index_uri, "--text-model", str(model)]
    cmd += ["--tables", tables.root_uri, "--port", str(port), "--review-token-file", str(token_file)]
    home = root / "dagster_home"  # the instance the review page reports its saved labels to
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VIDEO_SERVICE_ALLOWED_HOSTS": ALSO_HOST}
    env["DAGSTER_HOME"] = str(home)
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
        yield {
            "url": url,
            "clips": clips,
            "pid": proc.pid,
            "root": str(root),
            "token": token_file.read_text().strip(),
            "tables": tables,
            "home": home,
        }
    finally:
        stop(proc, grace_s=20)
        log.close()
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)  # gone (reaped)


# What structuring answered on three clips (the review page's queue): unsure on the coffee clip (the golden
# label: confirmed, a person lifts a kettle 0-2 s), a bare "possible" on fire2, nothing parsable on chaplin.
ANSWERS = {
    "sam2_04_coffee.mp4": {"status": "parsed", "verdict": "suspected", "confidence": 0.4, "events": [
        {"start_s": 0.0, "end_s": 1.5, "actor": "person", "action": "lift", "object": "kettle"}]},
    "fire2.mp4": {"status": "retried", "verdict": "possible", "confidence": None, "events": []},
    "chaplin.mp4": {"status": "unparsed", "verdict": None, "confidence": None, "events": []},
}  # fmt: skip


def _review_queue(tables, clips: dict[str, tuple[str, str]], now) -> None:
    """review_queue rows routed by the product's own routing (core.routing.split) from structured rows."""
    rows = [
        {"video_id": clips[f][0], "segment": 0, "use_case": "object_handling", "model_version": "1"}
        | {"prompt_version": 1, "use_case_version": "u1", "structurer": "s", "batch_key": "b1", "uri": clips[f][1]}
        | {"caption_digest": "d", "segment_start_s": 0.0, "segment_end_s": 8.0, **answer}
        for f, answer in ANSWERS.items()
    ]
    _, review = split(rows, 0.7, {(r["video_id"], 0): f"caption of {r['uri']}" for r in rows})
    review = [{**r, "routed_at": now} for r in review]
    tables.merge(REVIEW_QUEUE, to_arrow(REVIEW_QUEUE, review), KEYS[REVIEW_QUEUE])


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


def send(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_big(url: str, path: str, size: int, chunked: bool) -> int:
    """POST ``size`` bytes (with Content-Length, or chunked with none) and return the status; the server
    may answer and close before the body is sent, which is what a size limit enforced while reading does."""
    import http.client
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    conn.putrequest("POST", path)
    conn.putheader("Content-Type", "application/octet-stream")
    if chunked:
        conn.putheader("Transfer-Encoding", "chunked")
    else:
        conn.putheader("Content-Length", str(size))
    conn.endheaders()
    chunk = b"a" * (1024 * 1024)
    try:
        for _ in range(size // len(chunk)):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
        if chunked:
            conn.send(b"0\r\n\r\n")
    except OSError:  # the server answered and closed first
        pass
    try:
        return conn.getresponse().status
    finally:
        conn.close()


HOSTILE = [
    "inf", "-inf", "nan", "NaN", "1e308", "-1e308", "-1", "0", "1e9", "99999999999999999999999", "", " ", "'",
    "' OR 1=1 --", "x') OR (1=1", "%00", "%ED%A0%80", "..%2F..%2Fetc%2Fpasswd", "a" * 3000, "%E2%80%AE", "\\",
    "confirmed", "object_handling", "1", "0.5", "%0Aforged",
]  # fmt: skip


def test_no_input_makes_the_service_answer_500_or_leak_a_path(server):
    """A bounded, seeded fuzz of every endpoint with hostile values (non-finite and huge numbers, SQL
    quotes, NULs, lone surrogates, traversal, bidi overrides, megabytes of text): every answer is 2xx or
    4xx, never 5xx, and no answer names a server path; a registered file that is gone is 410."""
    import random
    from urllib.parse import quote

    url, root, vid = server["url"], server["root"], server["clips"][0]["sha256"]
    rng = random.Random(20261205)
    ids = [vid, "unknown", GONE_ID, "..%2F..%2Fetc%2Fpasswd", "%ED%A0%80"]
    routes = {
        "/api/search": ["q", "k", "offset", "sources", "w_lexical", "w_semantic", "video_id"],
        "/api/window": ["video_id", "start_s", "end_s"],
        "/api/frames/similar": ["video_id", "t", "k"],
        "/api/events": ["use_case", "verdict", "min_confidence", "after_s", "before_s", "video_id", "k"],
    }
    seen = set()

    def check(what, status, body):
        seen.add(status)
        assert status < 500, (what, status, body[:300])
        assert root.encode() not in body, (what, body[:300])

    for _ in range(300):
        path, names = rng.choice(list(routes.items()))
        picked = rng.sample(names, rng.randint(1, len(names)))
        query = "&".join(f"{n}={quote(rng.choice(HOSTILE + ids), safe='%')}" for n in picked)
        check(path + "?" + query, *send(f"{url}{path}?{query}"))
    for video in ids:
        for t in HOSTILE:
            check(f"thumbnail {video} {t}", *send(f"{url}/api/videos/{video}/thumbnail?t={quote(t, safe='%')}"))
        check(f"video {video}", *send(f"{url}/api/videos/{video}"))
        for rng_header in ("bytes=0-9", "bytes=-5", "bytes=9-0", "bytes=abc", "bytes=0-99999999999999999999"):
            check(f"file {video} {rng_header}", *send(f"{url}/api/videos/{video}/file", headers={"Range": rng_header}))
    for question in (b'{"question": "\\ud800"}', b'{"question": "\\ud800?", "k": 1e308}', b"{", b'{"k": "x"}'):
        check(f"ask {question!r}", *send(f"{url}/api/ask", "POST", question, {"Content-Type": "application/json"}))
    assert send(f"{url}/api/videos/{GONE_ID}/file")[0] == 410
    assert send(f"{url}/api/videos/{GONE_ID}/thumbnail?t=1")[0] == 410
    assert send(f"{url}/api/videos/{vid}/thumbnail?t=1e308")[0] == 422
    assert (
        send(f"{url}/api/events?after_s=nan")[0] == 422
        and send(f"{url}/api/window?video_id={vid}&start_s=0&end_s=inf")[0] == 422
    )
    assert send(f"{url}/api/events?use_case=x'%20OR%201=1%20--")[0] == 422
    for path in ("/api/frames/similar", "/api/ask"):  # 21 MB, stated or streamed: refused while it comes in
        assert post_big(url, path, 21 * 1024 * 1024, chunked=False) == 413
        assert post_big(url, path, 21 * 1024 * 1024, chunked=True) == 413
    assert {200, 404, 422} <= seen


def test_only_its_own_host_names_are_answered(server):
    """Issue 44: any Host header was answered, so a page on another name resolving to 127.0.0.1 (DNS
    rebinding) could read the archive through the operator's browser. The service bound to 127.0.0.1
    answers its address, localhost and the configured name; any other name gets 400 on every route."""
    from urllib.parse import urlsplit

    url, vid = server["url"], server["clips"][0]["sha256"]
    port = urlsplit(url).port
    routes = ["/", "/api/search?q=dog", f"/api/videos/{vid}/file", "/api/review/queue?use_case=object_handling"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"{ALSO_HOST}:{port}", f"[::1]:{port}"):
        assert get(url + routes[1], {"Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", "rebind.attacker.test", f"127.0.0.1.nip.io:{port}", f"x.{ALSO_HOST}"):
        for route in routes:
            status, _, body = get(url + route, {"Host": host})
            assert (status, body) == (400, b"Invalid host header"), (host, route)
    status, _ = send(url + REVIEW, "POST", b"{}", {"Host": "evil.example", "Content-Type": "application/json"})
    assert status == 400
    # Bound to every interface: their addresses and the host name, not any name.
    from video_assets.service.server import allowed_hosts

    everywhere = allowed_hosts("0.0.0.0", ["*.corp.example"])
    assert {"localhost", "127.0.0.1", "*.corp.example"} <= set(everywhere) and "evil.example" not in everywhere
    with pytest.raises(ValueError, match="VIDEO_SERVICE_ALLOWED_HOSTS"):
        allowed_hosts("127.0.0.1", ["archive.*.example"])


def _peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def test_an_image_upload_is_refused_by_its_pixels_before_it_is_decoded(server):
    """Issue 44: a 136 KB PNG of 12000x12000 pixels raised the service's memory by 1.4 GB. Its header is
    read first: over 40 megapixels is a 422 saying so, raw or multipart, and the peak memory does not move;
    a small image still decodes (then 503: this service has no frame encoder)."""
    import io

    from PIL import Image

    url, pid = server["url"], server["pid"]

    def png(size) -> bytes:
        out = io.BytesIO()
        Image.new("1", size).save(out, "PNG")  # 1 bit per pixel: a few KB however large
        return out.getvalue()

    bomb = png((12000, 12000))
    assert len(bomb) < 200_000
    before = _peak_rss_mb(pid)
    boundary = "b0undary"
    multipart = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + bomb
        + f"\r\n--{boundary}--\r\n".encode()
    )
    for body, kind in ((bomb, "image/png"), (multipart, f"multipart/form-data; boundary={boundary}")):
        status, answer = send(f"{url}/api/frames/similar", "POST", body, {"Content-Type": kind})
        assert status == 422 and "12000x12000 pixels is over 40 megapixels" in answer.decode(), (status, answer)
    assert _peak_rss_mb(pid) - before < 100, (before, _peak_rss_mb(pid))
    assert send(f"{url}/api/frames/similar", "POST", png((640, 480)), {"Content-Type": "image/png"})[0] == 503


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


REVIEW = "/api/review/labels?use_case=object_handling"


def post_label(server, body: dict, **headers) -> tuple[int, dict]:
    base = {"Content-Type": "application/json", "X-Review-Token": server["token"]}
    status, raw = send(server["url"] + REVIEW, "POST", json.dumps(body).encode(), {**base, **headers})
    return status, json.loads(raw)


def test_review_queue_and_who_may_write(server):
    url = server["url"]
    status, _, body = get(f"{url}/api/review/queue?use_case=object_handling")
    assert status == 200
    items = json.loads(body)["items"]
    # Low confidence first, then unparsed, then the rest.
    assert [i["uri"].rsplit("/", 1)[1] for i in items] == ["sam2_04_coffee.mp4", "chaplin.mp4", "fire2.mp4"]
    assert [i["tier"] for i in items] == ["low confidence", "unparsed", "other"]
    assert get(f"{url}/api/review/queue?use_case=nope")[0] == 404
    assert get(f"{url}/review")[0] == 200
    good = {"label_id": "refused-0001", "item_id": items[0]["item_id"], "action": "save", "reviewer": "ann"}
    good |= {"verdict": "confirmed", "events": [ANSWERS["sam2_04_coffee.mp4"]["events"][0]]}
    refused = [
        ({"X-Review-Token": ""}, good, 401),
        ({"X-Review-Token": "0" * 64}, good, 401),
        ({"Origin": "http://evil.example"}, good, 403),
        ({"Sec-Fetch-Site": "cross-site"}, good, 403),
        ({"Content-Type": "text/plain"}, good, 415),
        ({}, good | {"events": [{**good["events"][0], "end_s": -1}]}, 422),
        ({}, good | {"verdict": "definitely"}, 422),
        ({}, good | {"reviewer": "<script>"}, 422),
        ({}, good | {"item_id": "f" * 16}, 404),
    ]
    # Issue 44: times far past the clip's end (9.6 s, probed from its file), strings and booleans.
    event = good["events"][0]
    times = [
        ({"start_s": 5000.0, "end_s": 80000.0}, "events[0].start_s"),
        ({"end_s": 80000.0}, "events[0].end_s"),
        ({"start_s": "0", "end_s": "1.5"}, "events.0.start_s"),
        ({"start_s": False, "end_s": True}, "events.0.start_s"),
    ]
    refused += [({}, good | {"events": [event | t]}, 422) for t, _ in times]
    for headers, body, code in refused:
        status, answer = post_label(server, body, **headers)
        assert status == code, (headers, status, answer)
        assert answer["detail"] and server["token"] not in json.dumps(answer)
    for t, field in times:
        assert field in json.dumps(post_label(server, good | {"events": [event | t]})[1]), t
    # Nothing was written by any of them.
    assert json.loads(get(f"{url}/api/review/labels?use_case=object_handling")[2])["count"] == 0


def test_browser_review_corrects_a_label_that_reaches_the_golden_set(server, monkeypatch):
    from dagster import materialize

    from video_assets.core.evaluation.metrics import score_use_case, video_predictions
    from video_assets.core.tables import GOLDEN_SET, SCHEMAS
    from video_assets.defs.evaluation.assets import golden_set

    sync_api = playwright_sync_api()
    url, tables = server["url"], server["tables"]
    assert materialize([golden_set], resources={"tables": tables}).success
    before = tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET]).filter(ix.pl.col("use_case") == "object_handling")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        browser = launch(pw)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/review")
            page.fill("#reviewer", "ann")
            page.fill("#token", server["token"])
            sync_api.expect(page.locator("#queue li")).to_have_count(3)
            sync_api.expect(page.locator("#where")).to_contain_text("sam2_04_coffee.mp4")
            # The clip plays at the model's evidence (0-1.5 s).
            page.wait_for_function("() => document.getElementById('video').readyState >= 1", timeout=30000)
            t = page.evaluate("() => document.getElementById('video').currentTime")
            assert 0 <= t <= 1.75, t
            page.click("#excerpt")  # focus off the text fields, as a reviewer watching the clip
            page.keyboard.press("c")  # keyboard: confirmed
            assert page.is_checked("input[name=verdict][value=confirmed]")
            page.fill("#events tr:first-child input[name=end_s]", "3.0")
            page.click("#save")
            sync_api.expect(page.locator("#status")).to_contain_text("saved: corrected")
            # The next item opens; the decided one has left the queue.
            sync_api.expect(page.locator("#queue li")).to_have_count(2)
            sync_api.expect(page.locator("#where")).to_contain_text("chaplin.mp4")
            page.screenshot(path=str(SCREENSHOTS / "review.png"), full_page=True)
        finally:
            browser.close()
    saved = json.loads(get(f"{url}/api/review/labels?use_case=object_handling")[2])
    assert saved["count"] == 1
    label = saved["labels"][0]
    assert (label["decision"], label["verdict"], label["reviewer"]) == ("corrected", "confirmed", "ann")
    assert label["events"][0]["end_s"] == 3.0 and label["model_verdict"] == "suspected"
    # A double submit (the same save sent again) leaves one label.
    again = {"label_id": label["label_id"], "item_id": label["item_id"], "action": "save", "reviewer": "ann"}
    again |= {"verdict": "confirmed", "events": label["events"]}
    assert post_label(server, again) == (
        200,
        {"saved": False, "label_id": label["label_id"], "detail": "already saved (a repeated submit)"},
    )
    assert json.loads(get(f"{url}/api/review/labels?use_case=object_handling")[2])["count"] == 1
    # The saved label is a materialisation of review_labels on the service's instance (once: the repeat saved
    # nothing), and golden_set is its downstream in the graph.
    from dagster import AssetKey, DagsterInstance

    from video_assets.definitions import defs

    monkeypatch.setenv("DAGSTER_HOME", str(server["home"]))
    with DagsterInstance.get() as instance:
        records = instance.fetch_materializations(AssetKey("review_labels"), limit=10).records
    assert len(records) == 1
    reported = records[0].asset_materialization.metadata
    assert reported["label_id"].value == label["label_id"] and reported["decision"].value == "corrected"
    assert AssetKey("review_labels") in defs.resolve_asset_graph().get(AssetKey("golden_set")).parent_keys
    # golden_set takes the label: a new labels version, the clip's reviewed label replacing the shipped one.
    assert materialize([golden_set], resources={"tables": tables}).success
    after = tables.read(GOLDEN_SET, SCHEMAS[GOLDEN_SET]).filter(ix.pl.col("use_case") == "object_handling")
    assert after["labels_version"][0] != before["labels_version"][0] and after.height == before.height
    coffee = after.filter(ix.pl.col("file") == "sam2_04_coffee.mp4").to_dicts()[0]
    assert (coffee["source"], coffee["replaces_shipped"], coffee["reviewed_by"]) == ("reviewed", True, "ann")
    assert coffee["events"][0]["end_s"] == 3.0 and coffee["conflicts"]
    # The score follows the correction: a prediction of 0-3 s now matches the label exactly.
    vid = coffee["video_id"]
    predicted = video_predictions(
        [{"video_id": vid, "segment": 0, "status": "parsed", "verdict": "confirmed", "confidence": 0.9}
         | {"events": [{"start_s": 0.0, "end_s": 3.0, "actor": "person", "action": "lift", "object": "kettle"}]}]
    )  # fmt: skip
    scores = [
        score_use_case([g for g in df.to_dicts() if g["video_id"] == vid], predicted, 0.3, 10) for df in (before, after)
    ]
    ious = [s["metrics"]["mean_iou"] for s in scores]
    assert ious == [pytest.approx(2 / 3), pytest.approx(1.0)], ious
    exported = get(f"{url}/api/review/export?use_case=object_handling&reviewed_only=true")
    assert exported[0] == 200 and json.loads(exported[2].decode().strip())["events"][0]["end_s"] == 3.0
