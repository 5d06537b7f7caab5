"""Caption engine on plain transformers: CPU (tests, laptops) or a single GPU.

Loads ``AutoProcessor`` + ``AutoModelForImageTextToText`` once, then captions requests in batches
with left padding and greedy decoding. A batch that raises is retried one request at a time, so one
bad request costs only its own caption.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from video_assets.core.captioning.requests import (
    CaptionRequest,
    CaptionResponse,
    VideoChat,
    failed,
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
        chats: list[VideoChat | CaptionResponse] = []
        for req in requests:
            try:
                chats.append(VideoChat.of(req))
            except Exception as exc:
                chats.append(failed(req.request_id, f"{exc.__class__.__name__}: {exc}"))
        return self.generate_chats(chats)

    def generate_chats(self, chats: list[VideoChat | CaptionResponse]) -> list[CaptionResponse]:
        """One response per chat (a request already refused comes as its response), in order: a batch that
        raises is run again one chat at a time, so one bad request costs only its own caption."""
        results: dict[int, CaptionResponse] = {i: c for i, c in enumerate(chats) if isinstance(c, CaptionResponse)}
        valid = [(i, c) for i, c in enumerate(chats) if isinstance(c, VideoChat)]
        for start in range(0, len(valid), self.batch_size):
            chunk = valid[start : start + self.batch_size]
            try:
                for (i, _), resp in zip(chunk, self._run_batch([c for _, c in chunk])):
                    results[i] = resp
            except Exception as exc:
                if len(chunk) == 1:
                    i, chat = chunk[0]
                    results[i] = failed(chat.request_id, f"{exc.__class__.__name__}: {exc}")
                    continue
                log.warning("batch of %d failed (%s: %s); retrying one by one", len(chunk), type(exc).__name__, exc)
                for i, chat in chunk:
                    try:
                        results[i] = self._run_batch([chat])[0]
                    except Exception as exc1:
                        results[i] = failed(chat.request_id, f"{exc1.__class__.__name__}: {exc1}")
        return [results[i] for i in range(len(chats))]

    # -- internals --------------------------------------------------------------------------------

    def prepare(self, chats: list[VideoChat]) -> Any:
        """Processor inputs (a BatchFeature) for a batch: chat template text + one video per chat, with its
        metadata (the frames' real timing: ``requests.video_metadata``, what vLLM gets too)."""
        from transformers.video_utils import VideoMetadata

        texts, videos, metadata = [], [], []
        for chat in chats:
            video_part(chat.messages)  # exactly one video part, or a clear error
            texts.append(self.processor.apply_chat_template(chat.messages, tokenize=False, add_generation_prompt=True))
            _, h, w, _ = chat.frames.shape
            videos.append(chat.frames)
            metadata.append(VideoMetadata(width=w, height=h, **chat.metadata))
        return self.processor(
            text=texts,
            videos=videos,
            video_metadata=metadata,
            do_sample_frames=False,
            input_data_format="channels_last",  # (N, H, W, 3): never let the processor guess
            padding=True,
            return_tensors="pt",
        )

    def _run_batch(self, chats: list[VideoChat]) -> list[CaptionResponse]:
        from video_assets.core.inference import hf

        started = time.perf_counter()
        inputs = self.prepare(chats).to(self.device)
        limits = [max(1, min(chat.max_new_tokens, self.max_new_tokens)) for chat in chats]
        generated = hf.greedy(self.loaded, inputs, max(limits))
        input_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        latency = time.perf_counter() - started
        responses = []
        for chat, ids, n_in, limit in zip(chats, generated, input_tokens, limits):
            text, n_out = hf.completion(self.loaded, ids, limit)
            responses.append(
                CaptionResponse(
                    request_id=chat.request_id,
                    text=text,
                    input_tokens=int(n_in),
                    output_tokens=n_out,
                    latency_s=latency,
                )
            )
        return responses
