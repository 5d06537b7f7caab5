"""A tiny, randomly initialised CLIP built entirely offline, for tests of the CLIP-style frame encoder
(``video_assets.core.embeddings.frames.ClipEncoder``).

    TINY RANDOM TEST MODEL — embeddings are meaningless.

No CLIP weights are available offline, so this gives the real ``CLIPModel`` architecture (text and vision
towers, projections), a ``CLIPImageProcessor`` and a small word-level tokenizer trained here, with seeded
random weights: enough to exercise loading, preprocessing, batching, shapes and normalisation.
Built like ``tiny_vlm``: into a temporary folder, renamed into place, a marker file written last.
"""

from __future__ import annotations

import json
from pathlib import Path

from video_assets.core.models.folders import build_once
from video_assets.core.models.tiny_vlm import _CORPUS

TINY_CLIP_NAME = "tiny-random-clip"
WARNING = "TINY RANDOM TEST MODEL — embeddings are meaningless"
BUILD_VERSION = 1
MARKER = "tiny_build.json"  # written last: its presence (with matching version/seed) means a complete build
SPECIAL = {"pad": "<|pad|>", "unk": "<|unk|>", "bos": "<|startoftext|>", "eos": "<|endoftext|>"}
IMAGE_SIZE = 32
PATCH_SIZE = 8
MAX_TEXT_TOKENS = 32


def _is_complete(dest: Path, seed: int) -> bool:
    try:
        info = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if info.get("version") != BUILD_VERSION or info.get("seed") != seed:
        return False
    return all((dest / name).is_file() for name in info.get("files", []))


def build_tiny_clip(dest: str | Path, seed: int = 0) -> Path:
    """Build (or reuse) the tiny random CLIP in ``dest`` and return its path.

    Loadable with ``AutoModel``/``CLIPModel``, ``AutoTokenizer`` and ``AutoImageProcessor`` (all with
    ``local_files_only=True``). Deterministic for a given ``seed``; takes about a second.
    """
    return build_once(dest, lambda d: _is_complete(d, seed), lambda tmp: _build_into(tmp, seed))


def _tokenizer():
    """Lower-cased word-level tokenizer over ``_CORPUS``, wrapping every text in start/end tokens
    (CLIP's text tower pools at the end token)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk"]))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [SPECIAL["pad"], SPECIAL["unk"], SPECIAL["bos"], SPECIAL["eos"]]
    tok.train_from_iterator(_CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    bos, eos = SPECIAL["bos"], SPECIAL["eos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=SPECIAL["pad"],
        unk_token=SPECIAL["unk"],
        model_max_length=MAX_TEXT_TOKENS,
    )


def _build_into(folder: Path, seed: int) -> None:
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tokenizer = _tokenizer()
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=MAX_TEXT_TOKENS,
            # Not 2: eos 2 selects CLIP's legacy pooling (argmax of the ids) instead of the end token.
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        projection_dim=16,
    )
    config.architectures = ["CLIPModel"]
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = CLIPModel(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(folder)

    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_name_or_path"] = TINY_CLIP_NAME
    cfg["_tiny_test_model_warning"] = WARNING  # a stray copy is never mistaken for a real checkpoint
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    (folder / "README.md").write_text(
        f"# {TINY_CLIP_NAME}\n\n**{WARNING}.**\n\nRandomly initialised CLIP (hidden 32, 2 layers per tower, "
        f"{IMAGE_SIZE}px images, patch {PATCH_SIZE}) built by `video_assets.core.models.tiny_clip.build_tiny_clip` "
        f"for offline tests. Seed {seed}.\n",
        encoding="utf-8",
    )
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    info = {"name": TINY_CLIP_NAME, "warning": WARNING, "version": BUILD_VERSION, "seed": seed, "files": files}
    (folder / MARKER).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
