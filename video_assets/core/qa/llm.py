"""A chat client for an OpenAI-compatible server (vLLM's ``vllm serve <model>`` in production), through
the ``openai`` SDK: plain chat, and chat constrained to a JSON schema (``response_format``), with a
fallback to plain text + JSON extraction for servers that reject the schema."""

from __future__ import annotations

import json
from typing import Any

SETTING = "LLM_BASE_URL"  # the setting an operator changes when the endpoint cannot be reached


def _rejected() -> tuple[type[Exception], ...]:
    """400 and 422: the server does not take the request's form. (``openai`` is imported when a client is
    made: 0.7 s that every process loading the definitions paid, most never calling an LLM.)"""
    import openai

    return (openai.BadRequestError, openai.UnprocessableEntityError)


class LlmUnavailable(RuntimeError):
    """The endpoint could not be reached (connection refused, DNS, timeout) or refused the request."""


class LlmClient:
    """One OpenAI-compatible endpoint and model. ``model=""`` uses the first model the server lists."""

    def __init__(self, base_url: str, model: str = "", api_key: str = "EMPTY", timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self._model = model
        self.timeout_s = float(timeout_s)
        import openai

        self._client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "EMPTY", timeout=self.timeout_s, max_retries=1
        )

    def __repr__(self) -> str:  # never the key
        return f"LlmClient(base_url={self.base_url!r}, model={self._model!r})"

    @property
    def model(self) -> str:
        """The model requests name (resolved from ``GET /models`` once when not configured)."""
        if not self._model:
            models = self._call(lambda: self._client.models.list())
            ids = [m.id for m in models.data]
            if not ids:
                raise LlmUnavailable(f"the LLM endpoint {self.base_url} ({SETTING}) serves no model")
            self._model = ids[0]
        return self._model

    def check(self) -> str:
        """Fails fast (``LlmUnavailable`` naming ``LLM_BASE_URL``) unless the endpoint answers; the model."""
        self._call(lambda: self._client.models.list())
        return self.model

    def chat(
        self, messages: list[dict[str, str]], json_schema: dict | None = None, max_tokens: int | None = None
    ) -> str:
        """The reply's text. With ``json_schema``: decoding constrained to it (vLLM structured outputs);
        if the server rejects ``response_format``, asked in words and the JSON cut out of the reply."""
        extra: dict[str, Any] = {"max_tokens": max_tokens} if max_tokens else {}
        if json_schema is None:
            return self._complete(messages, **extra)
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": json_schema}}
        try:
            return self._complete(messages, response_format=fmt, **extra)
        except _rejected():  # 400/422: this server does not take response_format
            pass
        instruction = "Reply with JSON only, matching this JSON schema:\n" + json.dumps(json_schema)
        asked = [*messages[:-1], {**messages[-1], "content": f"{messages[-1]['content']}\n\n{instruction}"}]
        return extract_json(self._complete(asked, **extra))

    def _complete(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        model = self.model
        reply = self._call(
            lambda: self._client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)
        )
        return (reply.choices[0].message.content or "").strip() if reply.choices else ""

    def _call(self, fn):
        import openai

        try:
            return fn()
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            raise LlmUnavailable(
                f"the LLM endpoint {self.base_url} cannot be reached ({exc.__class__.__name__}: {exc}); "
                f"check {SETTING} (unset it to answer without a language model)"
            ) from exc
        except _rejected():
            raise
        except openai.APIStatusError as exc:
            raise LlmUnavailable(
                f"the LLM endpoint {self.base_url} ({SETTING}) answered HTTP {exc.status_code}: {exc.message}"
            ) from exc


def extract_json(text: str) -> str:
    """The first balanced JSON object or array in ``text`` (fences and prose around it dropped); the text
    itself when it holds none (the caller's validation then reports it)."""
    for start, ch in enumerate(text):
        if ch not in "{[":
            continue
        try:
            _, end = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            continue
        return text[start : start + end]
    return text
