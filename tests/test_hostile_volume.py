"""A hostile upload volume, generated here, through the real sensor tick and the real ingest assets:
every file is a row with an honest status and reason, every link is refused with a reason and never
followed, and nothing outside the volume's root is listed, hashed or opened."""

import hashlib
import io
import os
import shutil

import av
import numpy as np
import polars as pl
import pytest
from dagster import materialize
from PIL import Image

from tests.fixtures.samples import copy_samples
from tests.test_probe import make_clip, make_indexed_clip
from tests.test_sensor import tick
from video_assets.defs.ingest.assets import raw_videos, video_metadata

NEWLINE_NAME = "new\nline 2026-01-01 - dagster - ERROR - forged.mp4"


def audio_only(path) -> None:
    with av.open(str(path), "w", format="mp4") as out:
        sound = out.add_stream("aac", rate=8000, layout="mono")
        for k in range(8):
            chunk = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            chunk.sample_rate, chunk.pts = 8000, k * 1024
            for packet in sound.encode(chunk):
                out.mux(packet)
        for packet in sound.encode():
            out.mux(packet)


def huge_declared(src: bytes) -> bytes:
    """The clip with its MP4 headers (track header and sample entry) declaring 65535x65535."""
    data = bytearray(src)
    t = data.find(b"tkhd") + 4 + 76
    data[t : t + 8] = (65535 << 16).to_bytes(4, "big") * 2
    a = data.find(b"avc1") + 4 + 24
    data[a : a + 4] = (65535).to_bytes(2, "big") * 2
    return bytes(data)


def build_corpus(volume, outside):
    """name -> (expected ok, a fragment of the reason when not ok)."""
    expected = {}

    def put(name, payload, ok, reason=None):
        (volume / name).parent.mkdir(parents=True, exist_ok=True)
        (volume / name).write_bytes(payload)
        expected[name] = (ok, reason)

    clip = lambda name, **kw: open(make_clip(outside.parent / name, **kw), "rb").read()  # noqa: E731
    put("zero.mp4", b"", False, "empty file")
    whole = clip("moov_last.mp4", seconds=3)
    put("cut_index_last.mp4", whole[: len(whole) // 2], False, "cannot open")
    indexed = open(make_indexed_clip(outside.parent / "indexed.mp4"), "rb").read()
    put("cut_index_first.mp4", indexed[: len(indexed) // 2], False, "truncated: the video stream ends at")
    stated = open(make_indexed_clip(outside.parent / "stated.mkv"), "rb").read()
    put("cut_stated.mkv", stated[: len(stated) // 2], False, "truncated: the video stream ends at")
    put("random.mkv", np.random.default_rng(1).bytes(100_000), False, "cannot open")
    put("text.mp4", b"this is not a video\n" * 200, False, "cannot open")
    audio_only(outside.parent / "audio.mp4")
    put("audio_only.mp4", (outside.parent / "audio.mp4").read_bytes(), False, "no video stream")
    jpeg = io.BytesIO()
    Image.fromarray(np.full((48, 64, 3), 200, np.uint8)).save(jpeg, format="JPEG")
    put("photo.mp4", jpeg.getvalue(), False, "a still image")
    put("one_frame.mp4", clip("one.mp4", seconds=1, fps=1, audio=False), True)
    put("huge_declared.mp4", huge_declared(clip("huge.mp4", seconds=1, audio=False)), True)
    for i, name in enumerate(
        ["with spaces.mp4", "ünïcødé 日本.mp4", 'quote\'s "dq".mp4', "-leading-dash.mp4", NEWLINE_NAME]
    ):
        put(name, clip(f"named{i}.mp4", seconds=1, size=(64 + 16 * i, 48), audio=False), True)
    copy_samples(volume / "sub", ["realshort.mp4"])
    expected["sub/realshort.mp4"] = (True, None)
    return expected


@pytest.fixture
def outside(tmp_path):
    """A folder beside the volume holding a valid video: the sentinel nothing may read."""
    d = tmp_path / "outside"
    d.mkdir()
    make_clip(d / "secret.mp4", seconds=1, audio=False)
    return d


def test_every_hostile_file_is_a_row_or_refused_and_nothing_outside_is_read(instance, resources, volume_dir, outside):
    expected = build_corpus(volume_dir, outside)
    links = {
        "link_to_file.mp4": outside / "secret.mp4",
        "link_to_folder": outside,
        "passwd.mp4": "/etc/passwd",
        "loop": "..",
    }
    for name, target in links.items():
        os.symlink(target, volume_dir / name)
    os.mkfifo(volume_dir / "pipe.mp4")  # would block a reader forever

    result = tick(instance, resources)
    [key] = [r.partition_key for r in result.run_requests]
    [refused] = [e for e in result.asset_events if type(e).__name__ == "AssetObservation"]
    reasons = {r["uri"].rsplit("/", 1)[-1]: r["reason"] for r in refused.metadata["refused"].value}
    assert set(reasons) == {*links, "pipe.mp4"}
    assert all("symbolic link" in reasons[name] and "not followed" in reasons[name] for name in links)
    assert "not a regular file" in reasons["pipe.mp4"]

    run = materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=resources)
    assert run.success
    meta = pl.read_delta(resources["tables"].table_uri("video_metadata"))
    raw = pl.read_delta(resources["tables"].table_uri("raw_videos"))
    rel = {uri[len(str(volume_dir)) + 1 :]: (ok, err) for uri, ok, err in meta.select("uri", "ok", "error").iter_rows()}
    assert set(rel) == set(expected), "every file exactly one row, nothing else"
    assert raw.height == meta.height == len(expected)
    for name, (ok, reason) in expected.items():
        got_ok, error = rel[name]
        assert got_ok is ok, (name, error)
        if not ok:
            assert reason in error, (name, error)
    # Nothing read outside the root: no row names a path outside it or holds the secret's bytes.
    secret_id = hashlib.sha256((outside / "secret.mp4").read_bytes()).hexdigest()
    manifest = pl.read_delta(resources["tables"].table_uri("batch_manifest"))
    for table in (manifest, raw, meta):
        assert all(u.startswith(str(volume_dir) + "/") for u in table["uri"])
        assert not any(part in u for u in table["uri"] for part in ("/loop/", "/link_to_folder/", "secret"))
        assert secret_id not in table["video_id"].to_list()
    huge = meta.filter(pl.col("uri").str.ends_with("huge_declared.mp4"))
    assert (huge["width"][0], huge["height"][0]) == (96, 64)  # what decodes, not what the header claims

    # A name with a newline is escaped in the log: it cannot forge a second line.
    messages = [e.user_message for e in instance.all_logs(run.run_id)]
    assert any("new\\nline" in m for m in messages)
    assert not any("\nline 2026" in m for m in messages)


def test_a_file_swapped_for_a_link_after_listing_is_refused_on_open(instance, resources, volume_dir, outside):
    copy_samples(volume_dir, ["realshort.mp4"])
    make_clip(volume_dir / "swapped.mp4", seconds=1, audio=False)
    [key] = [r.partition_key for r in tick(instance, resources).run_requests]
    (volume_dir / "swapped.mp4").unlink()
    os.symlink(outside / "secret.mp4", volume_dir / "swapped.mp4")
    run = materialize([raw_videos, video_metadata], partition_key=key, instance=instance, resources=resources)
    assert run.success
    mat = instance.get_latest_materialization_event(raw_videos.key).asset_materialization
    [entry] = mat.metadata["refused_files"].value
    assert entry["uri"].endswith("swapped.mp4") and "symbolic link" in entry["reason"]
    raw = pl.read_delta(resources["tables"].table_uri("raw_videos"))
    assert [u.rsplit("/", 1)[-1] for u in raw["uri"]] == ["realshort.mp4"]
    # And the probe's own open refuses it too (a second line of defence for Ray workers).
    volume = resources["volume"]
    assert "symbolic link" in volume.refusal(str(volume_dir / "swapped.mp4"))
    from video_assets.defs.ingest.assets import probe_file

    assert "symbolic link" in probe_file(str(volume_dir / "swapped.mp4"), 1).error


def test_the_walk_lists_what_pyarrow_listed_so_known_files_stay_known(volume_dir):
    """Manifests written before the walk hold pyarrow's sizes and mtimes: the fingerprints must match."""
    import pyarrow.fs as pafs

    from resources.volume import VideoVolume
    from tests.fixtures.samples import SAMPLES
    from video_assets.core.uploads.discovery import fingerprint

    (volume_dir / "sub").mkdir()
    for sample in SAMPLES.glob("*.mp4"):  # whatever samples there are (the corpus's, or the bundled ones)
        shutil.copy(sample, volume_dir / "sub" / sample.name)
    listed = {fingerprint(f) for f in VideoVolume(uri=str(volume_dir)).list_files()}
    selector = pafs.FileSelector(str(volume_dir), recursive=True)
    before = {
        (e.path, e.size, int(round(e.mtime.timestamp() * 1_000_000)))
        for e in pafs.LocalFileSystem().get_file_info(selector)
        if e.type == pafs.FileType.File
    }
    assert listed == before and len(listed) > 3


HOSTILE_NAMES = {  # a real clip each (distinct bytes: distinct videos), under a name made to forge or hide
    "realshort.mp4": NEWLINE_NAME,
    "asl_eat.mkv": "rlo\u202evkm.mkv",  # a right-to-left override: shows as "rlomkv.mkv"-like text
    "chaplin.mp4": "tab\there\r\x1b[31mred.mp4",  # a tab, a carriage return and a terminal escape
}
RAW = ("\n", "\r", "\t", "\x1b", "\u202e")


@pytest.mark.slow
def test_hostile_names_never_reach_a_log_line_raw(
    instance, resources, session_ray, volume_dir, tiny_model_cache, tmp_path, capfd
):
    """A batch of hostile names through every per-batch step that names files or quotes a model
    (ingest, captions, structuring, routing): no message in the run's Dagster event log, and nothing
    the steps and Ray's workers printed, holds a raw control, format or line-break character; the
    names appear escaped instead."""
    from resources.mlflow_registry import MlflowRegistry
    from resources.structurer import StructurerSettings
    from resources.vlm import VlmSettings
    from tests.fixtures.samples import SAMPLES
    from video_assets.core.uploads.discovery import printable
    from video_assets.defs.captioning.assets import captions
    from video_assets.defs.ingest.registration import register_new_files
    from video_assets.defs.models.assets import caption_prompt, vlm_model
    from video_assets.defs.partitions import video_batches
    from video_assets.defs.routing.assets import routed_events
    from video_assets.defs.structuring.assets import structured_events

    for sample, name in HOSTILE_NAMES.items():
        shutil.copy(SAMPLES / sample, volume_dir / name)
    res = {
        **resources,
        **session_ray,
        "mlflow_registry": MlflowRegistry(
            tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art")
        ),
        "vlm": VlmSettings(cache_dir=str(tiny_model_cache), max_new_tokens=8, batch_size=2),
        "structurer": StructurerSettings(device="cpu"),
    }
    [key] = register_new_files(res["volume"], res["tables"]).batches
    instance.add_dynamic_partitions(video_batches.name, [key])
    assert materialize([vlm_model, caption_prompt], instance=instance, resources=res).success
    capfd.readouterr()  # what the model registration printed is not this batch's
    run = materialize(
        [raw_videos, video_metadata, captions, structured_events, routed_events],
        partition_key=key,
        instance=instance,
        resources=res,
        run_config={"ops": {"captions": {"config": {"max_frames": 4, "min_frames": 2}}}},
    )
    assert run.success
    printed = capfd.readouterr()
    messages = [e.user_message for e in instance.all_logs(run.run_id)]
    step_messages = [e.user_message for e in instance.all_logs(run.run_id) if e.step_key]
    assert step_messages, "the steps logged"
    for m in messages:
        assert not any(c in m for c in RAW), f"raw control character in a log message: {m!r}"
    for name in HOSTILE_NAMES.values():
        assert any(printable(name) in m for m in step_messages), f"{printable(name)} never logged"
        for stream in (printed.out, printed.err):
            assert name not in stream and name.split("\n")[-1] not in stream.replace(printable(name), "")
    assert not any(c in printed.out + printed.err for c in ("\u202e", "\x1b[31m"))
