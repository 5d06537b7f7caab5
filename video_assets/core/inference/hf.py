"""The one transformers load + greedy generation path, used by the caption engine and the structurer.

Both load a checkpoint the same way (device, dtype, left padding), generate greedily, and trim each
row at its own token limit and first end-of-sequence token the same way, so token counts mean the
same thing in ``captions`` and ``structured_events``: generated tokens including the EOS token
(what vLLM reports as ``num_generated_tokens``), text without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        # The checkpoint's own dtype on GPU; float32 on CPU where bf16 matmuls are slow or missing.
        return "auto" if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


@dataclass
class LoadedModel:
    model: Any
    chat: Any  # what carries the chat template: the processor of a VLM, else the tokenizer
    tokenizer: Any
    device: str
    eos_ids: frozenset[int]
    pad_id: int
    is_vlm: bool


def load(model_path: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """A VLM folder (processor + image-text-to-text model) or a causal text model (tokenizer + LM)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    device = resolve_device(device)
    is_vlm = hasattr(AutoConfig.from_pretrained(model_path), "vision_config")
    if is_vlm:
        from transformers import AutoModelForImageTextToText as Auto

        chat = AutoProcessor.from_pretrained(model_path)
        tokenizer = chat.tokenizer
    else:
        from transformers import AutoModelForCausalLM as Auto

        chat = tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"  # decoder-only batching: prompts end together
    model = Auto.from_pretrained(model_path, dtype=resolve_dtype(dtype, device)).to(device).eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    return LoadedModel(model, chat, tokenizer, device, eos_ids, pad_id, is_vlm)


def greedy(loaded: LoadedModel, inputs, max_new_tokens: int, logits_processor=None) -> list[list[int]]:
    """Greedy generation over a padded batch; the new token ids of each row (prompt removed)."""
    import torch

    with torch.inference_mode():
        out = loaded.model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=loaded.pad_id,
            logits_processor=logits_processor,
        )
    return out[:, inputs["input_ids"].shape[1] :].tolist()


def completion(loaded: LoadedModel, ids: list[int], limit: int) -> tuple[str, int]:
    """(text, generated tokens) of one row: cut at ``limit`` tokens and after the first EOS token,
    which counts as generated but is not part of the text."""
    kept: list[int] = []
    generated = 0
    for tid in ids[:limit]:
        generated += 1
        if tid in loaded.eos_ids:
            break
        kept.append(tid)
    return loaded.tokenizer.decode(kept, skip_special_tokens=True).strip(), generated
