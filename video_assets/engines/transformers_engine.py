"""Caption engine on plain transformers: CPU (tests, laptops) or a single GPU.

Loads ``AutoProcessor`` + ``AutoModelForImageTextToText`` once, then captions requests in batches
with left padding and greedy decoding. A batch that raises is retried one request at a time, so one
bad request costs only its own caption.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from video_assets.engines.base import (
    CaptionRequest,
    CaptionResponse,
    build_messages,
    failed,
    sampled_fps,
    validate_request,
    video_part,
)

log = logging.getLogger(__name__)


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        # The checkpoint's own dtype on GPU; float32 on CPU where bf16 matmuls are slow or missing.
        return "auto" if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


class TransformersEngine:
    name = "transformers"

    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 4,
        max_new_tokens: int = 128,
    ):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.model_path = str(model_path)
        self.device = _resolve_device(device)
        self.batch_size = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.processor = AutoProcessor.from_pretrained(self.model_path)
        self.processor.tokenizer.padding_side = "left"  # decoder-only batching: prompts end together
        self.model = AutoModelForImageTextToText.from_pretrained(
            self.model_path, dtype=_resolve_dtype(dtype, self.device)
        ).to(self.device)
        self.model.eval()
        tok = self.processor.tokenizer
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos_ids))
        self._torch = torch

    # -- public -----------------------------------------------------------------------------------

    def generate(self, requests: list[CaptionRequest]) -> list[CaptionResponse]:
        """One response per request, in request order."""
        results: dict[int, CaptionResponse] = {}
        valid: list[tuple[int, CaptionRequest, np.ndarray]] = []
        for i, req in enumerate(requests):
            try:
                valid.append((i, req, validate_request(req)))
            except Exception as exc:
                results[i] = failed(req.request_id, f"{exc.__class__.__name__}: {exc}")
        for start in range(0, len(valid), self.batch_size):
            chunk = valid[start : start + self.batch_size]
            try:
                for (i, _, _), resp in zip(chunk, self._run_batch(chunk)):
                    results[i] = resp
            except Exception as exc:
                if len(chunk) == 1:
                    i, req, _ = chunk[0]
                    results[i] = failed(req.request_id, f"{exc.__class__.__name__}: {exc}")
                    continue
                log.warning("batch of %d failed (%s: %s); retrying one by one", len(chunk), type(exc).__name__, exc)
                for item in chunk:
                    i, req, _ = item
                    try:
                        results[i] = self._run_batch([item])[0]
                    except Exception as exc1:
                        results[i] = failed(req.request_id, f"{exc1.__class__.__name__}: {exc1}")
        return [results[i] for i in range(len(requests))]

    # -- internals --------------------------------------------------------------------------------

    def prepare(self, items: list[tuple[int, CaptionRequest, np.ndarray]]) -> Any:
        """Processor inputs (a BatchFeature) for a batch: chat template text + one video per request."""
        from transformers.video_utils import VideoMetadata

        texts, videos, metadata = [], [], []
        for _, req, frames in items:
            messages = build_messages(req)
            part = video_part(messages)
            texts.append(
                self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
            n, h, w, _ = frames.shape
            fps = float(part.get("fps") or sampled_fps(req.timestamps))
            videos.append(frames)
            # The frames are the whole (already sampled) clip: sampled_fps == fps, so Qwen2.5-VL's
            # second_per_grid_ts = temporal_patch_size / fps matches the real spacing of the frames.
            metadata.append(
                VideoMetadata(
                    total_num_frames=n,
                    fps=fps,
                    width=w,
                    height=h,
                    duration=n / fps,
                    frames_indices=list(range(n)),
                )
            )
        return self.processor(
            text=texts,
            videos=videos,
            video_metadata=metadata,
            do_sample_frames=False,
            input_data_format="channels_last",  # (N, H, W, 3): never let the processor guess
            padding=True,
            return_tensors="pt",
        )

    def _run_batch(self, items: list[tuple[int, CaptionRequest, np.ndarray]]) -> list[CaptionResponse]:
        torch = self._torch
        started = time.perf_counter()
        inputs = self.prepare(items).to(self.device)
        limits = [max(1, min(req.max_new_tokens, self.max_new_tokens)) for _, req, _ in items]
        with torch.inference_mode():
            out = self.model.generate(
                **inputs,
                max_new_tokens=max(limits),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad_id,
            )
        prompt_len = inputs["input_ids"].shape[1]
        input_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        generated = out[:, prompt_len:].tolist()
        latency = time.perf_counter() - started
        responses = []
        for (_, req, _), ids, n_in, limit in zip(items, generated, input_tokens, limits):
            kept: list[int] = []
            for tid in ids[:limit]:
                kept.append(tid)
                if tid in self.eos_ids:
                    break
            text = self.processor.tokenizer.decode(kept, skip_special_tokens=True).strip()
            responses.append(
                CaptionResponse(
                    request_id=req.request_id,
                    text=text,
                    input_tokens=int(n_in),
                    output_tokens=len(kept),
                    latency_s=latency,
                )
            )
        return responses
