"""A tiny, randomly initialised Qwen2.5-VL built entirely offline: the demo's default model (laptop
runs with no hub) and the base of the test models (``tests/fixtures/tiny_models.py``).

    TINY RANDOM TEST MODEL — outputs are nonsense.

It has the real Qwen2.5-VL architecture, processor maths (patch 14, spatial merge 2, temporal patch 2,
the Qwen2-VL image and video processors, the Qwen2-VL chat template with image and video parts) and
special tokens, but a ~1k-token byte-level BPE trained here on a few dozen sentences and seeded
random weights. It exists so the captioning pipeline (batching, padding, video placeholders, M-RoPE
temporal positions, token counting, error handling) runs end to end without downloading gigabytes.

The special tokens' output rows are zeroed, so greedy decoding never emits a special token: every
generation runs to ``max_new_tokens`` and decodes to non-empty (nonsense) text.
"""

from __future__ import annotations

import json
from pathlib import Path

from video_assets.core.models.folders import build_once

TINY_MODEL_NAME = "tiny-random-qwen2.5-vl"
WARNING = "TINY RANDOM TEST MODEL — outputs are nonsense"
BUILD_VERSION = 1
MARKER = "tiny_build.json"  # written last: its presence (with matching version/seed) means a complete build

# The Qwen2-VL chat template as shipped with Qwen/Qwen2-VL-*-Instruct and Qwen/Qwen2.5-VL-*-Instruct.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's special tokens, in Qwen's id order (endoftext first). Ids here are 0..N-1.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

VOCAB_SIZE = 1024  # target for BPE training (the corpus may not support that many merges)

_CORPUS = [
    "A person picks up a red cup from the kitchen table.",
    "Two hands hold a small wooden box near the window.",
    "A woman walks across the room and opens the door.",
    "A man sits on a chair and reads a book in the garden.",
    "The child throws a blue ball to a dog on the grass.",
    "Someone pours water from a bottle into a glass.",
    "A hand turns the knob of the stove and the flame appears.",
    "People stand in a line outside a shop on a busy street.",
    "The camera pans left to show a car parked by the road.",
    "A person cuts vegetables with a knife on a cutting board.",
    "Hands type on a laptop keyboard at a desk with a lamp.",
    "A man carries a heavy bag up the stairs.",
    "The woman places a plate of food on the table.",
    "A cyclist rides past trees in a park during the day.",
    "Two people shake hands in an office with large windows.",
    "A person wipes the counter with a cloth and rinses it.",
    "The scene shows a beach with waves and a few people walking.",
    "A hand picks a pen from a cup and writes on paper.",
    "A boy opens the fridge and takes out a bottle of milk.",
    "The person puts on a jacket and leaves the house.",
    "At night, street lights shine on wet pavement.",
    "A cat jumps onto the sofa and lies down near a pillow.",
    "Someone folds clothes and stacks them on the bed.",
    "A woman waters plants on a balcony in the morning.",
    "The hands assemble small parts of a toy on the floor.",
    "A person lifts a box and moves it to the shelf.",
    "In the kitchen, a pot boils on the stove while steam rises.",
    "A group of friends sit around a table and talk.",
    "The man holds a phone to his ear and looks out the window.",
    "A person washes their hands at the sink with soap.",
    "The video shows a close view of fingers pressing buttons.",
    "A girl draws with colored pencils on a sheet of paper.",
    "Cars drive slowly through a crossing while people wait.",
    "A person opens a drawer, takes a spoon, and closes it.",
    "The dog runs across the yard and picks up a stick.",
    "Hands tie the laces of a pair of white shoes.",
    "A man paints a wall with a roller and a tray of paint.",
    "The woman slices bread and puts it in the toaster.",
    "First the person enters, then sits, then starts eating.",
    "From 0.0s to 2.5s a hand reaches for the cup; at 3.0s it drinks.",
    "The object is on the left; the person is on the right.",
    "Frames sampled at 0.0s, 1.0s, 2.0s and 3.0s show the same room.",
    "Describe what the people and their hands do with the objects in the scene.",
    "Summarize the actions in order with their start and end times.",
    "An elderly man adjusts his glasses and turns the page of a newspaper.",
    "A worker in a yellow helmet climbs a ladder beside a brick building.",
    "Fingers scroll through photos on a tablet resting on a wooden bench.",
    "Two children build a sandcastle while their parents watch nearby.",
    "A chef flips pancakes in a frying pan and stacks them on a plate.",
    "Rain falls on umbrellas as commuters hurry toward the train station.",
    "A mechanic tightens bolts under the hood of a silver truck.",
    "The audience claps as a musician bows on a brightly lit stage.",
    "A gardener kneels and plants seedlings in neat rows of dark soil.",
    "Snow covers the mountains; skiers glide down a steep white slope.",
    "A nurse checks a patient's pulse and writes notes on a clipboard.",
    "Someone unlocks a bicycle, adjusts the seat, and pedals away quickly.",
    "Close-up: a thumb presses the shutter button of an old film camera.",
    "A teenager juggles three oranges in the middle of a crowded market.",
    "Customers browse shelves of books under warm yellow ceiling lights.",
    "A baker kneads dough, sprinkles flour, and shapes a round loaf.",
    "Waiters carry trays of drinks between tables on a sunny terrace.",
    "A fisherman casts a net from a small boat at sunrise.",
    "Hands knit a striped scarf with two long wooden needles.",
    "A puppy chews a shoe, then hides under the kitchen chair.",
]


def _is_complete(dest: Path, seed: int, variant: str | None = None) -> bool:
    marker = dest / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if info.get("version") != BUILD_VERSION or info.get("seed") != seed or info.get("variant") != variant:
        return False
    return all((dest / name).is_file() for name in info.get("files", []))


def build_tiny_qwen25_vl(
    dest: str | Path, seed: int = 0, variant: str | None = None, customize=None, text_config: dict | None = None
) -> Path:
    """Build (or reuse) the tiny random Qwen2.5-VL in ``dest`` and return its path.

    ``customize(model, tokenizer, special_ids)`` edits the weights before saving (tests pin a token
    preference this way); ``text_config`` overrides entries of the language model's config (tests
    widen the attention heads for vLLM this way); ``variant`` names the edit, so builds with different
    edits never reuse each other's folder. Without either, the demo model.

    Loadable with ``AutoProcessor.from_pretrained(dest)`` and
    ``AutoModelForImageTextToText.from_pretrained(dest)``. Deterministic for a given ``seed``, so the
    folder's content fingerprint is stable. Building takes a few seconds; an existing complete build
    of the same version, seed and variant is returned untouched.
    """
    if (variant is None) != (customize is None and text_config is None):
        raise ValueError("variant goes with customize and/or text_config")
    return build_once(
        dest,
        lambda d: _is_complete(d, seed, variant),
        lambda tmp: _build_into(tmp, seed, variant, customize, text_config),
    )


def _train_tokenizer():
    """Byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained on ``_CORPUS``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def _build_into(
    folder: Path, seed: int, variant: str | None = None, customize=None, text_config_overrides: dict | None = None
) -> None:
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2Tokenizer,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    vocab, merges = _train_tokenizer()
    ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        errors="replace",
        split_special_tokens=False,
    )
    assert all(tokenizer.convert_tokens_to_ids(t) == i for t, i in ids.items()), "special token ids moved"
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    vocab_size = len(tokenizer)

    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        use_sliding_window=False,
        max_window_layers=2,
    )
    text_config.update(text_config_overrides or {})
    vision_config = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        tokens_per_second=2,  # as in the real Qwen2.5-VL checkpoints
        window_size=112,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config._name_or_path = TINY_MODEL_NAME

    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        # Never emit special tokens (logit 0 vs. a max over ~1k random positives): nonsense text, never empty.
        head = model.get_output_embeddings().weight
        for tid in ids.values():
            head[tid].zero_()
        if customize is not None:
            customize(model, tokenizer, list(ids.values()))
    model.name_or_path = TINY_MODEL_NAME
    gen = model.generation_config
    gen.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen.pad_token_id = ids["<|endoftext|>"]
    gen.bos_token_id = ids["<|endoftext|>"]
    gen.do_sample = False
    gen.temperature = None
    gen.top_p = None
    gen.top_k = None
    model.save_pretrained(folder, safe_serialization=True)

    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},  # Qwen2.5-VL's min/max pixels
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(
        size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 768},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        do_sample_frames=False,  # frames arrive already sampled
        cap_pixels_per_frame=True,
    )
    processor = Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)

    # Label the config itself, so a stray copy is never mistaken for a real checkpoint.
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_name_or_path"] = TINY_MODEL_NAME
    cfg["_tiny_test_model_warning"] = WARNING
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")

    n_params = sum(p.numel() for p in model.parameters())
    (folder / "README.md").write_text(
        f"# {TINY_MODEL_NAME}\n\n"
        f"**{WARNING}.**\n\n"
        "Randomly initialised Qwen2.5-VL architecture (text: hidden 64, 2 layers; vision: depth 2) with a\n"
        "byte-level BPE tokenizer trained locally on a few dozen sentences, built by\n"
        "`video_assets.core.models.tiny_vlm.build_tiny_qwen25_vl` for offline runs and tests. It uses the real Qwen2-VL image and\n"
        "video processors and chat template, so token counts and vision placeholders behave like the real\n"
        f"model. Seed {seed}; {n_params:,} parameters. Never use it for anything but plumbing tests.\n",
        encoding="utf-8",
    )
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    (folder / MARKER).write_text(
        json.dumps(
            {
                "name": TINY_MODEL_NAME,
                "warning": WARNING,
                "version": BUILD_VERSION,
                "seed": seed,
                "variant": variant,
                "files": files,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
