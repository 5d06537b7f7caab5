"""GPU check: the project's transformers caption engine on a FULL-SIZE random-weight Qwen2.5-VL.

Made for a GPU machine with no network that has only torch + transformers (+ numpy, pillow): no PyAV,
Ray, Dagster or MLflow. It imports nothing from this project but modules that need only those
(``video_assets.core.captioning.requests``, ``...captioning.transformers_engine``,
``video_assets.core.inference.hf`` and the offline tokenizer/processor builder
``video_assets.core.models.tiny_vlm``).

It builds a Qwen2.5-VL with the real 3B (default) or 7B Instruct shapes and random bf16 weights on
the GPU, saves it with a Qwen2.5-VL processor/tokenizer borrowed from the tiny model builder, loads it
through ``TransformersEngine`` and captions synthetic frames (random uint8) at several batch sizes
and frame counts, printing requests/s, frames/s, output tokens/s and peak GPU memory.

Throughput only: the weights are random, so the captions are nonsense; every generation runs to
``--max-new-tokens`` (the special tokens' output rows are zeroed, so no end-of-sequence is ever chosen).
The tokenizer is the tiny model's ~1k-token BPE, not Qwen's 151k vocabulary: the embedding and LM head
have the real size, but prompts tokenize differently (text tokens are a small share of a video prompt).

    python scripts/gpu_check.py                       # 3B shape, batch 1/4/8 x 8/16/32 frames at 448x448
    python scripts/gpu_check.py --shape 7b --json out.json
    python scripts/gpu_check.py --smoke               # CPU, tiny model: plumbing only, not a benchmark
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Modules of this project or its orchestration stack that must never be needed here.
FORBIDDEN_PREFIXES = ("resources", "dagster", "dagster_ray", "ray", "mlflow", "deltalake", "polars", "av")
ALLOWED_PROJECT_MODULES = {
    "video_assets",
    "video_assets.core",
    "video_assets.core.captioning",
    "video_assets.core.captioning.requests",
    "video_assets.core.captioning.transformers_engine",
    "video_assets.core.inference",
    "video_assets.core.inference.hf",
    "video_assets.core.models",
    "video_assets.core.models.folders",  # tiny_vlm's build-once helper (standard library only)
    "video_assets.core.models.tiny_vlm",
}

# Text and vision shapes of Qwen/Qwen2.5-VL-3B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct (their config.json).
_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    tokens_per_second=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    hidden_act="silu",
)
SHAPES = {
    "3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
            max_window_layers=70,
        ),
        vision=dict(_VISION, out_hidden_size=2048),
        tie_word_embeddings=True,
    ),
    "7b": dict(
        text=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            max_window_layers=28,
        ),
        vision=dict(_VISION, out_hidden_size=3584),
        tie_word_embeddings=False,
    ),
}
MROPE_SECTION = [16, 24, 24]  # real checkpoints' rope_scaling.mrope_section (head_dim 128)
SPECIAL = ("<|endoftext|>", "<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def make_config(shape: str, ids: dict[str, int]):
    """The real ``shape``'s config with the borrowed tokenizer's special-token ids."""
    from transformers import Qwen2_5_VLConfig

    spec = SHAPES[shape]
    text_config = dict(
        spec["text"],
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION},
        use_sliding_window=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=spec["vision"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def build_full_size(shape: str, tiny_dir: Path, dest: Path, device: str) -> dict:
    """A random-weight Qwen2.5-VL of the real ``shape``, bf16, saved with the tiny model's processor."""
    import torch
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_dir)
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    spec = SHAPES[shape]
    config = make_config(shape, ids)
    started = time.perf_counter()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        # Never choose a special token or an id the borrowed tokenizer cannot decode: logit 0 against a
        # max over ~1k random logits, so every generation runs to max_new_tokens.
        head = model.get_output_embeddings().weight
        head[len(tok) :].zero_()
        for i in {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens} | set(ids.values()):
            head[i].zero_()
    gen = model.generation_config
    gen.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen.pad_token_id = ids["<|endoftext|>"]
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    built_s = time.perf_counter() - started
    started = time.perf_counter()
    model.save_pretrained(dest, safe_serialization=True)
    processor.save_pretrained(dest)
    saved_s = time.perf_counter() - started
    del model, head
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "parameters": n_params,
        "vocab_size_model": spec["text"]["vocab_size"],
        "vocab_size_tokenizer": len(tok),
        "build_s": round(built_s, 2),
        "save_s": round(saved_s, 2),
    }


def synthetic_requests(n: int, frames: int, size: int, max_new_tokens: int, seed: int):
    import numpy as np

    from video_assets.core.captioning.requests import CaptionRequest

    rng = np.random.default_rng(seed)
    return [
        CaptionRequest(
            request_id=f"r{i}",
            frames=rng.integers(0, 256, size=(frames, size, size, 3), dtype=np.uint8),
            timestamps=[float(t) for t in range(frames)],  # 1 fps
            prompt="Describe what happens in this video, in order, with times.",
            max_new_tokens=max_new_tokens,
        )
        for i in range(n)
    ]


def measure(engine, batch: int, frames: int, size: int, max_new_tokens: int, cuda: bool) -> dict:
    import torch

    requests = synthetic_requests(batch, frames, size, max_new_tokens, seed=batch * 1000 + frames)
    engine.batch_size = batch  # one generate call for the whole batch
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    responses = engine.generate(requests)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    errors = [r.error for r in responses if r.error]
    out_tokens = sum(r.output_tokens for r in responses)
    return {
        "batch": batch,
        "frames": frames,
        "size": size,
        "wall_s": round(wall, 3),
        "requests_per_s": round(batch / wall, 3),
        "frames_per_s": round(batch * frames / wall, 2),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "input_tokens_per_request": max((r.input_tokens for r in responses), default=0),
        "output_tokens": out_tokens,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "errors": len(errors),
        "first_error": errors[0][:300] if errors else None,
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'batch':>5} {'frames':>6} {'req/s':>8} {'frames/s':>9} {'out tok/s':>10} {'peak GPU GiB':>12} {'errors':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        peak = "n/a" if r["peak_gpu_gib"] is None else f"{r['peak_gpu_gib']:.2f}"
        print(
            f"{r['batch']:>5} {r['frames']:>6} {r['requests_per_s']:>8.3f} {r['frames_per_s']:>9.2f} "
            f"{r['output_tokens_per_s']:>10.2f} {peak:>12} {r['errors']:>6}"
        )
    for r in rows:
        if r["first_error"]:
            print(f"batch {r['batch']} x {r['frames']} frames failed: {r['first_error']}")


def loaded_forbidden() -> list[str]:
    """Modules this check must not need that ended up imported (should be empty)."""
    bad = []
    for name in sorted(sys.modules):
        top = name.split(".")[0]
        if top in FORBIDDEN_PREFIXES or (top == "video_assets" and name not in ALLOWED_PROJECT_MODULES):
            bad.append(name)
    return bad


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="3b", help="real Qwen2.5-VL shape to build")
    p.add_argument("--smoke", action="store_true", help="CPU-only plumbing run on the tiny random model")
    p.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4,8; smoke 1,2)")
    p.add_argument("--frames", default=None, help="comma-separated frame counts (default 8,16,32; smoke 4)")
    p.add_argument("--size", type=int, default=None, help="frame side in pixels (default 448; smoke 112)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per request (default 64)")
    p.add_argument("--workdir", default=None, help="where the model is saved (default: a temporary folder)")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    from video_assets.core.captioning.transformers_engine import TransformersEngine
    from video_assets.core.models.tiny_vlm import WARNING, build_tiny_qwen25_vl

    smoke = args.smoke
    batches = _ints(args.batch_sizes or ("1,2" if smoke else "1,4,8"))
    frame_counts = _ints(args.frames or ("4" if smoke else "8,16,32"))
    size = args.size or (112 if smoke else 448)
    max_new = args.max_new_tokens or (8 if smoke else 64)
    if size % 28:
        print(f"--size {size} is not a multiple of 28 (patch 14 x merge 2)", file=sys.stderr)
        return 2
    cuda = not smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device visible: run on a GPU machine, or use --smoke for a CPU plumbing run", file=sys.stderr)
        return 2
    device = "cpu" if smoke else "cuda"
    info: dict = {
        "mode": "smoke (tiny random model on CPU: plumbing only, not a benchmark)"
        if smoke
        else f"full-size random-weight Qwen2.5-VL-{args.shape.upper()} shape, bf16",
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "size": size,
        "max_new_tokens": max_new,
    }
    print(
        f"gpu_check: {info['mode']} on {info['device']} (torch {torch.__version__}, transformers {transformers.__version__})"
    )

    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=args.workdir) as tmp:
        tmp = Path(tmp)
        tiny = build_tiny_qwen25_vl(tmp / "tiny")
        if smoke:
            model_dir = tiny
            info["model"] = f"tiny-random-qwen2.5-vl ({WARNING})"
        else:
            model_dir = tmp / f"qwen2.5-vl-{args.shape}-random"
            info["model"] = f"Qwen2.5-VL-{args.shape.upper()} shape, random weights"
            info.update(build_full_size(args.shape, tiny, model_dir, device))
            print(
                f"built {info['parameters'] / 1e9:.2f}B parameters in {info['build_s']} s, saved in {info['save_s']} s; "
                f"NOTE: the tokenizer is the tiny model's ({info['vocab_size_tokenizer']} tokens), not Qwen's "
                f"({info['vocab_size_model']}-row embedding/LM head kept at the real size)"
            )
        started = time.perf_counter()
        engine = TransformersEngine(str(model_dir), device=device, dtype="auto", max_new_tokens=max_new)
        info["load_s"] = round(time.perf_counter() - started, 2)
        info["dtype"] = str(next(engine.loaded.model.parameters()).dtype)
        print(f"loaded through TransformersEngine in {info['load_s']} s ({info['dtype']} on {engine.device})")
        # Warm-up (CUDA context, kernels, allocator): not reported.
        measure(engine, 1, min(frame_counts), size, min(max_new, 4), cuda)
        rows = []
        for frames in frame_counts:
            for batch in batches:
                rows.append(measure(engine, batch, frames, size, max_new, cuda))
                r = rows[-1]
                print(f"  batch {batch} x {frames} frames: {r['wall_s']} s", flush=True)
        del engine

    print()
    print_table(rows)
    info["forbidden_modules_loaded"] = loaded_forbidden()
    if info["forbidden_modules_loaded"]:
        print(f"WARNING: modules this check should not need were imported: {info['forbidden_modules_loaded']}")
    if smoke:
        print("\nsmoke run: tiny random model on CPU, plumbing only; these numbers are not a benchmark")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
