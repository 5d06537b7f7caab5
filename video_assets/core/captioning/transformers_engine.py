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

from video_assets.core.captioning.requests import (
    CaptionRequest,
    CaptionResponse,
    build_messages,
    failed,
    validate_request,
    video_metadata,
    video_part,
)

log = logging.getLogger(__name__)


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
        from video_assets.core.inference import hf

        self.model_path = str(model_path)
        self.batch_size = max(1, int(batch_size))
        self.max_new_tokens = int(max_new_tokens)
        self.loaded = hf.load(self.model_path, device, dtype)
        if not self.loaded.is_vlm:
            raise ValueError(f"{self.model_path} is not a vision-language model (no vision_config): it cannot caption")
        self.processor = self.loaded.chat
        self.device = self.loaded.device

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
            video_part(messages)  # exactly one video part, or a clear error
            texts.append(self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            _, h, w, _ = frames.shape
            videos.append(frames)
            # The same metadata the vLLM engine sends (requests.video_metadata): one timing on both engines.
            metadata.append(VideoMetadata(width=w, height=h, **video_metadata(req.timestamps)))
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
        from video_assets.core.inference import hf

        started = time.perf_counter()
        inputs = self.prepare(items).to(self.device)
        limits = [max(1, min(req.max_new_tokens, self.max_new_tokens)) for _, req, _ in items]
        generated = hf.greedy(self.loaded, inputs, max(limits))
        input_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        latency = time.perf_counter() - started
        responses = []
        for (_, req, _), ids, n_in, limit in zip(items, generated, input_tokens, limits):
            text, n_out = hf.completion(self.loaded, ids, limit)
            responses.append(
                CaptionResponse(
                    request_id=req.request_id, text=text, input_tokens=int(n_in), output_tokens=n_out, latency_s=latency
                )
            )
        return responses
