"""The embeddings core on real models and real clips: packaged MiniLM, packaged EfficientNet-Lite0,
a tiny locally built CLIP, RapidOCR. Nothing is mocked; nothing is downloaded."""

import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from tests.fixtures.samples import REPO, clip
from video_assets.core.embeddings.frames import (
    PACKAGED_EFFICIENTNET,
    ClipEncoder,
    EfficientNetLiteEncoder,
    FrameEncoder,
    frame_encoder,
)
from video_assets.core.embeddings.similarity import cosine_matrix, project_2d, scatter_png, top_k
from video_assets.core.embeddings.text import PACKAGED_MINILM, TextEncoder, packaged_minilm_dir
from video_assets.core.media.sampling import SamplingConfig, sample_video

SHARED_GOLDEN = REPO.parent / "shared" / "golden" / "object_handling.jsonl"
GOLDEN = (
    SHARED_GOLDEN if SHARED_GOLDEN.exists() else REPO / "video_assets" / "usecases" / "object_handling" / "golden.jsonl"
)
# Four clips that look nothing alike (all in the bundled subset).
CLIPS = ["bottle-detection.mp4", "chaplin.mp4", "sam2_04_coffee.mp4", "tree.avi"]
FRAMES_PER_CLIP = 6

# Light rewrites: word-for-word synonyms (whole words, case kept) plus clause reordering below.
SYNONYMS = {
    "man": "guy",
    "woman": "lady",
    "signs": "gestures",
    "office": "workplace",
    "street": "road",
    "cars": "vehicles",
    "car": "vehicle",
    "bicycles": "bikes",
    "table": "desk",
    "takes": "grabs",
    "returns": "puts back",
    "walks": "strolls",
    "camera": "cam",
    "film": "movie",
    "lifts": "raises",
    "jump": "bounce",
    "jumps": "bounces",
    "children": "kids",
    "shot": "clip",
    "footage": "video",
    "close-up": "closeup",
    "people": "persons",
    "nothing": "no content",
    "almost": "nearly",
    "heavily": "strongly",
    "copy": "version",
    "view": "shot",
    "clip": "video",
}


def paraphrase(caption: str) -> str:
    """Synonyms swapped in, and the clauses of a caption split by ';' put in reverse order."""

    def swap(m):
        word = m.group(0)
        new = SYNONYMS.get(word.lower())
        if new is None:
            return word
        return new[0].upper() + new[1:] if word[0].isupper() else new

    text = re.sub(r"[A-Za-z][A-Za-z-]*", swap, caption)
    clauses = [c.strip().rstrip(".") for c in text.split(";")]
    if len(clauses) < 2:
        return text
    joined = "; ".join(reversed(clauses)) + "."
    return joined[0].upper() + joined[1:]


def golden_captions() -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["file"], r["reference_caption"]) for r in rows if r.get("reference_caption")]


# ---------------------------------------------------------------- fixtures (one model load per module)


@pytest.fixture(scope="module")
def text_encoder():
    return TextEncoder(PACKAGED_MINILM)


@pytest.fixture(scope="module")
def efficientnet():
    return EfficientNetLiteEncoder()


@pytest.fixture(scope="module")
def clip_frames():
    """{clip: (n, h, w, 3) frames} sampled exactly as the captioning pipeline samples them."""
    cfg = SamplingConfig(fps=1.0, min_frames=FRAMES_PER_CLIP, max_frames=FRAMES_PER_CLIP, motion_densify=False)
    out = {}
    for name in CLIPS:
        video = sample_video(str(clip(name)), cfg)
        out[name] = np.concatenate([s.frames for s in video.segments])
    return out


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_clip import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("models") / "tiny-clip")


# ---------------------------------------------------------------- text


def test_core_has_no_dagster_imports():
    core = REPO / "video_assets" / "core"
    for path in (core / "embeddings").glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+dagster", path.read_text(), re.M), path


def test_packaged_minilm_dir_holds_the_model():
    folder = packaged_minilm_dir()
    assert (folder / "config.json").exists() and (folder / "modules.json").exists()


@pytest.mark.slow
def test_text_encoder_shape_norm_and_empty(text_encoder):
    assert text_encoder.dim == 384
    vecs = text_encoder.encode(["A hand picks up a bottle.", "Night view of skyscrapers."])
    assert vecs.shape == (2, 384) and vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    empty = text_encoder.encode([])
    assert empty.shape == (0, 384) and empty.dtype == np.float32


@pytest.mark.slow
def test_captions_are_nearest_to_their_paraphrase(text_encoder):
    pairs = golden_captions()
    assert len(pairs) >= 10, GOLDEN
    captions = [c for _, c in pairs]
    rewrites = [paraphrase(c) for c in captions]
    assert sum(r != c for r, c in zip(rewrites, captions)) >= 0.8 * len(captions), "rewrites too light"

    text_encoder.encode(captions[:4])  # warm-up: the first batch pays one-off costs, not throughput
    start = time.perf_counter()
    cap = text_encoder.encode(captions)
    para = text_encoder.encode(rewrites)
    rate = 2 * len(captions) / (time.perf_counter() - start)

    to_para = np.sum(cap * para, axis=1)
    among = cosine_matrix(cap, cap)
    np.fill_diagonal(among, -np.inf)
    wins = to_para > among.max(axis=1)
    losers = [
        (pairs[i][0], round(float(to_para[i]), 3), pairs[int(among[i].argmax())][0]) for i in np.flatnonzero(~wins)
    ]
    share = float(wins.mean())
    print(
        f"\nMiniLM: {share:.0%} of {len(captions)} captions nearest their paraphrase; {rate:.0f} sentences/s; misses {losers}"
    )
    assert share >= 0.9, losers
    # Paraphrases retrieve their caption: top-1 over all captions.
    idx, _ = top_k(para, cap, 1)
    assert float(np.mean(idx[:, 0] == np.arange(len(captions)))) >= 0.9


# ---------------------------------------------------------------- frames


@pytest.mark.slow
def test_efficientnet_frames_cluster_by_clip(efficientnet, clip_frames):
    assert isinstance(efficientnet, FrameEncoder) and not efficientnet.text_capable
    assert efficientnet.dim == 1280 and efficientnet.name == PACKAGED_EFFICIENTNET
    labels, vecs = [], []
    efficientnet.encode_images(clip_frames[CLIPS[0]][:1])  # warm-up, kept out of the ms/frame
    start = time.perf_counter()
    for name, frames in clip_frames.items():
        v = efficientnet.encode_images(frames)  # (n, h, w, 3) array, as sample_video gives it
        assert v.shape == (len(frames), 1280) and v.dtype == np.float32
        vecs.append(v)
        labels += [name] * len(frames)
    ms = 1000 * (time.perf_counter() - start) / len(labels)
    vecs = np.concatenate(vecs)
    labels = np.array(labels)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)

    sims = cosine_matrix(vecs, vecs)
    report = {}
    for name in CLIPS:
        own = labels == name
        intra = sims[np.ix_(own, own)][~np.eye(own.sum(), dtype=bool)].mean()
        inter = sims[np.ix_(own, ~own)].mean()
        report[name] = (round(float(intra), 3), round(float(inter), 3))
        assert intra > inter + 0.05, (name, intra, inter)
    np.fill_diagonal(sims, -np.inf)
    nn_same = float(np.mean(labels[sims.argmax(axis=1)] == labels))
    print(
        f"\nEfficientNet-Lite0: {ms:.1f} ms/frame; (intra, inter) {report}; nearest neighbour same clip {nn_same:.0%}"
    )
    assert nn_same >= 0.85

    # A list of frames of different sizes gives the same vectors as the array.
    first = clip_frames[CLIPS[0]]
    np.testing.assert_allclose(efficientnet.encode_images(list(first[:2])), vecs[:2], atol=1e-5)
    assert efficientnet.encode_images([]).shape == (0, 1280)
    with pytest.raises(TypeError, match="images only"):
        efficientnet.encode_texts(["a bottle"])

    png = scatter_png(project_2d(vecs), list(labels), title="EfficientNet-Lite0 frames")
    assert Image.open(io.BytesIO(png)).format == "PNG"


# ---------------------------------------------------------------- CLIP


@pytest.mark.slow
def test_tiny_clip_images_and_texts_share_a_space(tiny_clip):
    enc = frame_encoder("tiny-clip", tiny_clip)
    assert isinstance(enc, ClipEncoder) and enc.text_capable and isinstance(enc, FrameEncoder)
    frames = np.random.default_rng(0).integers(0, 256, size=(3, 45, 80, 3), dtype=np.uint8)
    images = enc.encode_images(frames)
    texts = enc.encode_texts(["a hand picks up a red cup", "night view of a city", "zzz unknown words"])
    assert images.shape == (3, enc.dim) and texts.shape == (3, enc.dim)
    assert images.dtype == texts.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(images, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(texts, axis=1), 1.0, atol=1e-5)
    assert cosine_matrix(texts, images).shape == (3, 3)
    # Deterministic: the same input twice (and a list instead of an array) gives the same vectors.
    np.testing.assert_array_equal(images, enc.encode_images(list(frames)))
    np.testing.assert_array_equal(
        texts, enc.encode_texts(["a hand picks up a red cup", "night view of a city", "zzz unknown words"])
    )
    assert not np.allclose(images[0], images[1])
    assert enc.encode_texts([]).shape == (0, enc.dim)
    # A rebuild with the same seed is reused untouched.
    from tests.fixtures.tiny_clip import build_tiny_clip

    assert build_tiny_clip(tiny_clip) == tiny_clip


@pytest.mark.slow
def test_frame_encoder_picks_by_source(tiny_clip, tmp_path):
    assert isinstance(frame_encoder(PACKAGED_EFFICIENTNET, None), EfficientNetLiteEncoder)
    assert isinstance(frame_encoder(str(tiny_clip), None), ClipEncoder)  # the source itself as the folder
    not_clip = tmp_path / "bert"
    not_clip.mkdir()
    (not_clip / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="'my-bert'.*not a CLIP-style"):
        frame_encoder("my-bert", not_clip)
    with pytest.raises(ValueError, match="'nowhere'"):
        frame_encoder("nowhere", tmp_path / "missing")
    with pytest.raises(ValueError, match="not a CLIP-style"):
        ClipEncoder(not_clip)


# ---------------------------------------------------------------- OCR


@pytest.mark.slow
def test_ocr_reads_large_text():
    from video_assets.core.embeddings.ocr import FrameOcr

    img = Image.new("RGB", (640, 360), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=48)
    draw.text((40, 60), "KITCHEN", fill="black", font=font)
    draw.text((380, 60), "Camera 2", fill="black", font=font)
    draw.text((40, 220), "Aisle seven", fill="black", font=font)
    frame = np.asarray(img)
    ocr = FrameOcr()
    ocr.read(frame)  # first call loads the ONNX sessions
    start = time.perf_counter()
    lines = ocr.read(frame)
    ms = 1000 * (time.perf_counter() - start)
    text = ocr.text(frame)
    print(f"\nRapidOCR: {ms:.0f} ms/frame (640x360); read {text!r}")
    assert "kitchen" in text.lower() and "aisle" in text.lower()
    assert text.lower().index("kitchen") < text.lower().index("camera") < text.lower().index("aisle")
    assert all(0.5 <= ln["score"] <= 1 and len(ln["box"]) == 4 for ln in lines)
    assert ocr.text(np.full((120, 200, 3), 255, np.uint8)) == ""  # a blank frame reads as no text


# ---------------------------------------------------------------- similarity


def test_project_2d_keeps_clusters_apart_and_is_deterministic():
    rng = np.random.default_rng(0)
    a = rng.normal(0, 1, (30, 64)) + 4.0
    b = rng.normal(0, 1, (30, 64)) - 4.0
    pts = project_2d(np.concatenate([a, b]))
    assert pts.shape == (60, 2) and pts.dtype == np.float32
    pa, pb = pts[:30], pts[30:]
    gap = np.linalg.norm(pa.mean(0) - pb.mean(0))
    spread = max(pa.std(0).max(), pb.std(0).max())
    assert gap > 5 * spread
    # The first axis separates them completely.
    assert pa[:, 0].min() > pb[:, 0].max() or pb[:, 0].min() > pa[:, 0].max()
    np.testing.assert_array_equal(pts, project_2d(np.concatenate([a, b])))
    # The axes' signs follow the data, not the SVD routine: shuffled rows give the same points, shuffled.
    perm = rng.permutation(60)
    np.testing.assert_allclose(project_2d(np.concatenate([a, b])[perm]), pts[perm], atol=1e-3)
    assert project_2d(np.ones((1, 5))).shape == (1, 2)

    png = scatter_png(pts, ["a"] * 30 + ["b"] * 30, title="two clusters")
    image = Image.open(io.BytesIO(png))
    image.load()
    assert image.format == "PNG" and image.width > 100


def test_cosine_and_top_k():
    m = np.array([[1, 0], [0, 1], [1, 1], [-1, 0]], dtype=np.float32)
    sims = cosine_matrix(m, m)
    np.testing.assert_allclose(np.diag(sims), 1.0, atol=1e-6)
    assert sims[0, 3] == pytest.approx(-1.0)
    idx, scores = top_k(np.array([1.0, 0.2]), m, 3)
    assert idx.tolist() == [0, 2, 1] and scores[0] >= scores[1] >= scores[2]
    idx2, _ = top_k(m[:2], m, 10)
    assert idx2.shape == (2, 4) and idx2[:, 0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="dimension"):
        cosine_matrix(m, np.ones((2, 3)))
