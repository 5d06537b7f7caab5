"""Pure registry rules: hashing, discovery, batching."""

import hashlib
import io
from datetime import UTC, datetime

import pytest

from video_assets.core.uploads import discovery as registry
from video_assets.core.uploads.discovery import VolumeFile, sha256_stream

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)


def test_streamed_hash_equals_whole_file_hash():
    data = bytes(range(256)) * 40_000  # ~10 MB, several chunks
    assert sha256_stream(io.BytesIO(data), chunk=1 << 20) == hashlib.sha256(data).hexdigest()


def files(*names, size=10, mtime=1.0):
    return [VolumeFile(f"/v/{n}", size, mtime) for n in names]


def test_discover_skips_seen_and_marks_duplicates():
    listing = files("a.mp4", "b.mp4", "c.mp4", "copy_of_a.mp4")
    content = {"/v/a.mp4": "h1", "/v/b.mp4": "h2", "/v/c.mp4": "h3", "/v/copy_of_a.mp4": "h1"}
    seen = {registry.fingerprint(listing[1])}  # b seen already
    found, remaining = registry.discover(listing, seen, {"h3": "/old/c.mp4"}, content.__getitem__)
    assert remaining == 0
    by_uri = {d.uri: d for d in found}
    assert set(by_uri) == {"/v/a.mp4", "/v/c.mp4", "/v/copy_of_a.mp4"}
    assert by_uri["/v/a.mp4"].duplicate_of is None
    assert by_uri["/v/copy_of_a.mp4"].duplicate_of == "/v/a.mp4"
    assert by_uri["/v/c.mp4"].duplicate_of == "/old/c.mp4"


def test_discover_bounds_the_hashing_per_call():
    listing = files(*[f"{i:02d}.mp4" for i in range(10)])
    found, remaining = registry.discover(listing, set(), {}, lambda uri: uri, max_files=4)
    assert [d.uri for d in found] == [f"/v/{i:02d}.mp4" for i in range(4)]
    assert remaining == 6


def test_a_modified_file_is_new_bytes():
    before = VolumeFile("/v/a.mp4", 10, 1.0)
    after = VolumeFile("/v/a.mp4", 10, 2.0)
    assert registry.fingerprint(before) != registry.fingerprint(after)
    assert registry.listing_digest([before]) != registry.listing_digest([after])


def discoveries(n):
    return [registry.Discovery(f"/v/{i:03d}.mp4", 1, 1.0, f"h{i:03d}", None) for i in range(n)]


def test_batches_are_bounded_deterministic_and_exclude_duplicates():
    ds = discoveries(7) + [registry.Discovery("/v/dup.mp4", 1, 1.0, "h000", "/v/000.mp4")]
    plan = registry.plan_batches(ds, NOW, batch_size=3)
    assert [len(v) for v in plan.values()] == [3, 3, 1]
    assert all(d.duplicate_of is None for v in plan.values() for d in v)
    assert plan.keys() == registry.plan_batches(list(reversed(ds)), NOW, batch_size=3).keys()
    assert all(k.startswith("b20261202T120000-") for k in plan)
    assert len(set(plan)) == 3


def test_batch_size_must_be_positive():
    with pytest.raises(ValueError):
        registry.plan_batches(discoveries(2), NOW, batch_size=0)


def test_manifest_rows_keep_every_file():
    ds = discoveries(2) + [registry.Discovery("/v/dup.mp4", 1, 1.0, "h000", "/v/000.mp4")]
    plan = registry.plan_batches(ds, NOW)
    rows = registry.manifest_rows(ds, plan, NOW)
    assert len(rows) == 3
    dup = next(r for r in rows if r["uri"] == "/v/dup.mp4")
    assert dup["status"] == "duplicate" and dup["batch_key"] is None and dup["duplicate_of"] == "/v/000.mp4"
    assert {r["batch_key"] for r in rows if r["status"] == "batched"} == set(plan)


def test_printable_escapes_what_could_forge_a_log_line():
    from video_assets.core.uploads.discovery import printable

    name = "evil\n2026-01-01 - dagster - INFO - forged.mp4"
    assert "\n" not in printable(name) and printable(name).startswith("evil\\n2026")
    assert printable("a\rb\tc\x1bd\u2028e\u202ef") == "a\\rb\\tc\\x1bd\\u2028e\\u202ef"
    assert printable("café 日本 'q' \"dq\" -lead.mp4") == "café 日本 'q' \"dq\" -lead.mp4"  # printable text kept
