"""Probe every sample against MANIFEST.csv, plus generated broken files."""

import csv
import io
import os

import pytest

from tests.conftest import SAMPLES
from video_assets.probe import probe

MANIFEST = SAMPLES / "MANIFEST.csv"
pytestmark = pytest.mark.skipif(not MANIFEST.exists(), reason="sample corpus with MANIFEST.csv not present")


def manifest_rows():
    if not MANIFEST.exists():
        return []
    return list(csv.DictReader(MANIFEST.open()))


def _codec(manifest_value: str) -> str:
    return manifest_value.split("(")[0]


@pytest.mark.parametrize("row", manifest_rows(), ids=lambda r: r["file"])
def test_probe_matches_manifest(row):
    result = probe(str(SAMPLES / row["file"]))
    if row["file"] == "carphone_distorted.mp4" and not result.ok:
        assert result.error  # allowed to fail, never without a reason
        return
    assert result.ok, result.error
    assert result.container == row["container"]
    assert result.video_codec == _codec(row["video_codec"])
    width, height = map(int, row["resolution"].split("x"))
    assert (result.width, result.height) == (width, height)
    assert result.rotation == int(row["rotation"])
    expected = float(row["duration_s"])
    if expected > 0:
        assert result.duration_s == pytest.approx(expected, rel=0.05)
        assert result.duration_estimated is False
    assert result.frame_count and result.frame_count > 0
    has_audio = row["audio"] != "no"
    assert (result.audio_codec is not None) == has_audio
    if has_audio:
        assert result.audio_codec == row["audio"].split("/")[0]


def test_fire2_rotation_and_variable_frame_rate():
    result = probe(str(SAMPLES / "fire2.mp4"))
    assert result.rotation == -180
    assert result.real_fps == pytest.approx(90000.0)
    assert result.avg_fps == pytest.approx(10.505, rel=0.01)


def test_webm_without_duration_gets_an_estimate():
    result = probe(str(SAMPLES / "no_duration.webm"))
    assert result.ok
    assert result.duration_estimated is True
    # 74 frames at 14.985 fps: the estimate comes from packet timestamps
    assert result.duration_s == pytest.approx(result.frame_count / 14.985, rel=0.05)


def test_keyframe_interval_where_the_stream_has_several():
    result = probe(str(SAMPLES / "cityCC0.mpg"))
    assert result.keyframe_interval_s == pytest.approx(0.48, abs=0.02)  # a GOP of 12 at 25 fps


def test_probe_accepts_a_seekable_stream():
    data = (SAMPLES / "realshort.mp4").read_bytes()
    assert probe(io.BytesIO(data)).ok


@pytest.mark.parametrize(
    "name,payload",
    [
        ("empty.mp4", b""),
        ("random.mp4", os.urandom(200_000)),
        ("text.mp4", b"this is not a video\n" * 100),
    ],
)
def test_bad_files_are_rows_with_a_reason(tmp_path, name, payload):
    path = tmp_path / name
    path.write_bytes(payload)
    result = probe(str(path))
    assert result.ok is False
    assert result.error and len(result.error) > 10


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.9])
def test_truncated_files_never_raise(tmp_path, fraction):
    data = (SAMPLES / "sam2_04_coffee.mp4").read_bytes()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: int(len(data) * fraction)])
    result = probe(str(path))
    assert result.ok is False or result.duration_s  # either usable or explained
    if not result.ok:
        assert result.error
