"""Videos in a bucket: sampling and probing read an S3 object through ranged reads (moto's S3 server
on 127.0.0.1), give the same frames as the local file, and close every stream they open."""

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from tests.conftest import BUNDLED
from video_assets.core.media import source
from video_assets.core.media.sampling import SamplingConfig, SamplingError, sample_video
from video_assets.defs.ingest.assets import probe_file

CLIP = "realshort.mp4"
# Motion and scene-cut passes reopen the source: force both on a short clip.
CFG = SamplingConfig(long_video_s=0.5, scene_split=True, max_frames=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible server on loopback for this module; stopped by PID."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("moto_server is not installed (dev extra: moto[server])")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("moto_server did not start within 30 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, monkeypatch):
    """A bucket holding one bundled clip; the AWS_* variables point pyarrow at the local server."""
    for k, v in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(k, v)
    name = f"videos-{time.monotonic_ns()}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, allow_bucket_creation=True).create_dir(name)
    fs, _ = pafs.FileSystem.from_uri(f"s3://{name}")
    with fs.open_output_stream(f"{name}/{CLIP}") as out:
        out.write((BUNDLED / CLIP).read_bytes())
    return name


def test_sampling_an_s3_object_gives_the_local_frames(bucket):
    remote = sample_video(f"s3://{bucket}/{CLIP}", CFG)
    local = sample_video(BUNDLED / CLIP, CFG)
    assert remote.decode_stats["motion"] == local.decode_stats["motion"] is not None  # the reopening passes ran
    assert [s.timestamps for s in remote.segments] == [s.timestamps for s in local.segments]
    assert all(np.array_equal(r.frames, lo.frames) for r, lo in zip(remote.segments, local.segments, strict=True))


def test_every_stream_opened_is_closed(bucket, monkeypatch):
    opened = []
    real = source.open_media

    def recording(uri):
        target = real(uri)
        opened.append(target)
        return target

    monkeypatch.setattr(source, "open_media", recording)
    sample_video(f"s3://{bucket}/{CLIP}", CFG)
    assert len(opened) >= 2 and all(s.closed for s in opened)  # the main pass and the motion pass
    opened.clear()
    with pytest.raises(SamplingError, match="cannot open as a media container"):
        sample_video(f"s3://{bucket}/{CLIP}.missing", CFG)
    with pytest.raises(FileNotFoundError):
        real(f"s3://{bucket}/{CLIP}.missing")


def test_probe_reads_the_object(bucket):
    remote = probe_file(f"s3://{bucket}/{CLIP}", (BUNDLED / CLIP).stat().st_size)
    local = probe_file(str(BUNDLED / CLIP), (BUNDLED / CLIP).stat().st_size)
    assert remote.ok and remote == local
