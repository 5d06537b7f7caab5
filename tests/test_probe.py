"""Probe every sample against MANIFEST.csv, generated clips of known make, plus generated broken files.

Runs on a clean clone: only the tests of corpus-only clips skip when the corpus is absent (the rest
use the bundled samples or files generated here)."""

import csv
import io
import os
from fractions import Fraction

import av
import numpy as np
import pytest

from tests.fixtures.samples import MANIFEST, SHARED_SAMPLES, corpus
from tests.fixtures.samples import clip as sample
from video_assets.core.media.probe import probe


def manifest_rows():
    if not MANIFEST.exists():
        return [pytest.param(None, id="no-corpus", marks=corpus)]
    return [pytest.param(r, id=r["file"], marks=corpus) for r in csv.DictReader(MANIFEST.open())]


def clip(name: str) -> str:
    """A sample by name (see tests/fixtures/samples.py: a corpus-only one needs @pytest.mark.corpus)."""
    return str(sample(name))


def make_clip(path, size=(96, 64), fps=25, seconds=3, gop=12, audio=True) -> str:
    """An H.264 mp4 of known make: ``fps * seconds`` frames, a keyframe every ``gop`` frames, optional AAC."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=fps, options={"g": str(gop), "sc_threshold": "0", "bf": "0"})
        video.width, video.height, video.pix_fmt = *size, "yuv420p"
        sound = out.add_stream("aac", rate=8000, layout="mono") if audio else None
        for i in range(fps * seconds):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i * 3 % 256, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if sound:
            for k in range(seconds * 8):
                chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = 8000, k * 1024
                for packet in sound.encode(chunk):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)
    return str(path)


def _codec(manifest_value: str) -> str:
    return manifest_value.split("(")[0]


@pytest.mark.parametrize("row", manifest_rows())
def test_probe_matches_manifest(row):
    result = probe(str(SHARED_SAMPLES / row["file"]))
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


@pytest.mark.parametrize("size,audio", [((96, 64), True), ((64, 96), False)])
def test_probe_reads_a_clip_of_known_make(tmp_path, size, audio):
    result = probe(make_clip(tmp_path / "made.mp4", size=size, fps=25, seconds=3, gop=12, audio=audio))
    assert result.ok, result.error
    assert (result.container, result.video_codec) == ("mov,mp4,m4a,3gp,3g2,mj2", "h264")
    assert (result.width, result.height, result.rotation) == (*size, 0)
    assert result.duration_s == pytest.approx(3.0, abs=0.05) and result.duration_estimated is False
    assert result.frame_count == 75 and result.avg_fps == pytest.approx(25.0)
    assert result.keyframe_interval_s == pytest.approx(12 / 25, abs=0.01)
    assert result.audio_codec == ("aac" if audio else None)


def test_fire2_rotation_and_variable_frame_rate():
    result = probe(clip("fire2.mp4"))
    assert result.rotation == -180
    assert result.real_fps == pytest.approx(90000.0)
    assert result.avg_fps == pytest.approx(10.505, rel=0.01)


def test_webm_without_duration_gets_an_estimate():
    result = probe(clip("no_duration.webm"))
    assert result.ok
    assert result.duration_estimated is True
    # 74 frames at 14.985 fps: the estimate comes from packet timestamps
    assert result.duration_s == pytest.approx(result.frame_count / 14.985, rel=0.05)


@corpus
def test_keyframe_interval_where_the_stream_has_several():
    result = probe(clip("cityCC0.mpg"))
    assert result.keyframe_interval_s == pytest.approx(0.48, abs=0.02)  # a GOP of 12 at 25 fps


def test_probe_accepts_a_seekable_stream():
    with open(clip("realshort.mp4"), "rb") as f:
        data = f.read()
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
    with open(clip("sam2_04_coffee.mp4"), "rb") as f:
        data = f.read()
    path = tmp_path / "cut.mp4"
    path.write_bytes(data[: int(len(data) * fraction)])
    result = probe(str(path))
    assert result.ok is False or result.duration_s  # either usable or explained
    if not result.ok:
        assert result.error


def make_indexed_clip(path, fmt=None, seconds=4, fps=25) -> str:
    """A clip whose header states its duration before the data: MP4 with the index first (faststart)
    or Matroska. Noise frames, so the bytes spread evenly over the clip's time."""
    options = {"movflags": "+faststart"} if str(path).endswith(".mp4") else {}
    rng = np.random.default_rng(0)
    with av.open(str(path), "w", format=fmt, options=options) as out:
        video = out.add_stream("libx264", rate=fps, options={"g": str(fps), "bf": "0"})
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        for _ in range(fps * seconds):
            pixels = rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
    return str(path)


@pytest.mark.parametrize("name", ["indexed.mp4", "stated.mkv"])
def test_a_file_cut_short_is_not_ok_even_when_its_header_states_the_duration(tmp_path, name):
    whole = make_indexed_clip(tmp_path / name)
    data = open(whole, "rb").read()
    if name.endswith(".mp4"):
        assert data.find(b"moov") < data.find(b"mdat")  # the index really is at the front
    whole_result = probe(whole)
    assert whole_result.ok and whole_result.duration_s == pytest.approx(4.0, abs=0.05)

    cut = tmp_path / f"cut_{name}"
    cut.write_bytes(data[: len(data) // 2])
    result = probe(str(cut))
    assert result.ok is False
    assert result.error.startswith("truncated: the video stream ends at ")
    ends_at = float(result.error.split(" ends at ")[1].split(" s")[0])
    assert 1.0 < ends_at < 3.0 and "of the 4.00 s" in result.error


def make_vfr_clip(path, frames=300, step_ms=50) -> str:
    """Frames every ``step_ms`` (20 fps) in a stream declared at 29.97 fps, with explicit pts."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=Fraction(30000, 1001), options={"bf": "0", "g": "30"})
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        video.time_base = Fraction(1, 1000)
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i % 256, np.uint8), format="rgb24")
            frame.pts, frame.time_base = i * step_ms, Fraction(1, 1000)
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
    return str(path)


@pytest.mark.parametrize("name", ["vfr.mkv", "vfr.mp4"])
def test_variable_frame_rate_comes_from_the_packets(tmp_path, name):
    path = make_vfr_clip(tmp_path / name)
    if name.endswith(".mkv"):  # the header really claims the declared rate (the 29.97 vs 20.0)
        with av.open(path) as container:
            assert float(container.streams.video[0].average_rate) == pytest.approx(29.97, abs=0.01)
    result = probe(path)
    assert result.ok, result.error
    assert result.frame_count == 300
    assert result.avg_fps == pytest.approx(20.0, rel=0.01)
    assert result.duration_s == pytest.approx(15.0, abs=0.1)


def make_sparse_avi(path, frames=20, every=6, fps=15) -> str:
    """An AVI holding a picture every ``every`` ticks: the muxer fills the gaps with empty drop-frame
    chunks, so the header counts every tick (115) while only ``frames`` pictures exist."""
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 9 % 256, np.uint8), format="rgb24")
            frame.pts, frame.time_base = i * every, Fraction(1, fps)
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
    return str(path)


def test_an_avi_header_counting_drop_frames_is_corrected_by_the_packets(tmp_path):
    path = make_sparse_avi(tmp_path / "sparse.avi")
    with av.open(path) as container:
        assert container.streams.video[0].frames == 115  # the header's claim
        decoded = sum(1 for _ in container.decode(video=0))
    result = probe(path)
    assert result.ok, result.error
    assert result.frame_count == decoded == 20
    assert result.avg_fps == pytest.approx(15 / 6, rel=0.01)  # a picture every 6 ticks of 1/15 s


def test_tree_avi_has_68_frames_not_the_444_its_header_claims():
    result = probe(clip("tree.avi"))
    assert result.ok and result.frame_count == 68
    assert result.avg_fps == pytest.approx(68 / 29.6, rel=0.02)


def test_a_damaged_stream_in_a_sound_container_is_rejected(tmp_path):
    whole = bytearray(open(make_clip(tmp_path / "c.mp4", size=(320, 240), seconds=2, audio=False), "rb").read())
    at = whole.find(b"mdat") + 4
    end = at - 8 + int.from_bytes(whole[at - 8 : at - 4], "big")
    whole[at + 64 : end] = np.random.default_rng(0).bytes(end - at - 64)  # the coded pictures become noise
    path = tmp_path / "noise.mp4"
    path.write_bytes(whole)
    result = probe(str(path))
    assert result.ok is False
    assert result.error.startswith("no decodable video frame")


@pytest.mark.parametrize("degrees", [90, -90, 180])
def test_rotation_read_from_the_boxes_matches_the_decoded_frame(tmp_path, degrees):
    path = tmp_path / "rotated.mp4"
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.set_display_rotation(degrees)
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
    with av.open(str(path)) as container:
        decoded = next(container.decode(video=0)).rotation
    assert decoded != 0
    assert probe(str(path)).rotation == decoded
    with open(path, "rb") as f:  # a stream source too (the object store's path)
        assert probe(io.BytesIO(f.read())).rotation == decoded
