"""Any OpenAI-compatible chat endpoint as an engine (``VLM_ENGINE=endpoint``): a vLLM server a user already
runs, or a hosted VLM API. Requests go through Ray Data LLM's HTTP stage (``HttpRequestProcessorConfig``:
a QPS limit per batch, retries with exponential backoff on 429/408/502/503/504, timeouts and dropped
connections), one chat completion per row.

Two details of our own, both in ``EndpointRequestUDF``:
- The payload travels through Ray Data as JSON text: as a column, Arrow would unify the content parts'
  (text / image) and the JSON schemas' structs, filling every missing key with null, which servers refuse.
- A batch whose request still fails after the retries fails in Ray's stage; the job drops it after the
  bounded tries every engine stage gets (``core.inference.retries``) and its rows become error rows. An
  answer with an HTTP error (4xx, 500) is that row's error, the others' answers are kept.

The API key goes in the request header only: never in a row, a log line, a repr or the registry."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from video_assets.core.inference.retries import VLM_BATCH_RETRIES
from video_assets.core.inference.vllm import ERROR_KEY, bounded_engine_retries  # Ray Data LLM's, not vLLM's

SETTING = "VLM_ENDPOINT_URL"
PAYLOAD = "payload_json"


class EndpointUnavailable(RuntimeError):
    """The endpoint did not answer; the message names the setting."""


def check_url(url: str) -> str:
    """The endpoint's base URL (``http(s)://host[:port]/v1``), without a trailing slash; ValueError naming
    the setting for anything else, or for credentials in the URL (they belong in VLM_ENDPOINT_API_KEY)."""
    url = (url or "").strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{SETTING}={url!r} is not an http(s) URL such as http://127.0.0.1:8000/v1")
    if parts.username or parts.password:
        raise ValueError(f"{SETTING} must not carry credentials; put the key in VLM_ENDPOINT_API_KEY")
    if parts.query or parts.fragment:
        raise ValueError(f"{SETTING}={url!r}: a base URL takes no query or fragment")
    return url


@dataclass(frozen=True)
class Endpoint:
    """One OpenAI-compatible endpoint and model; plain data, shipped to Ray workers."""

    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str = field(default="", repr=False)
    qps: int | None = None  # requests per second per batch (Ray's HTTP stage); None: as fast as answered
    timeout_s: float = 120.0  # per request, then retried
    retries: int = VLM_BATCH_RETRIES
    batch_size: int = 4
    concurrency: int = 1  # HTTP stage actors (each sends its batch's requests concurrently)

    def public(self) -> dict[str, str]:
        """What may be shown (metadata, logs, the registry): never the key."""
        return {"url": self.url, "model": self.model}

    def check(self) -> None:
        """Fails fast, naming the setting, unless ``GET {url}/models`` answers (any HTTP answer counts)."""
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.url}/models", headers=self.headers())
        try:
            urllib.request.urlopen(request, timeout=min(self.timeout_s, 10.0)).close()
        except urllib.error.HTTPError:
            return  # it answered
        except OSError as exc:
            raise EndpointUnavailable(
                f"the VLM endpoint {self.url} ({SETTING}) did not answer: {exc.__class__.__name__}: {exc}"
            ) from None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def payload_row(payload: dict[str, Any]) -> dict[str, Any]:
    """A row for the HTTP stage: the request body as JSON text (see the module docstring)."""
    return {"payload": {PAYLOAD: json.dumps(payload)}, ERROR_KEY: ""}


def error_row(error: str) -> dict[str, Any]:
    """A row the HTTP stage skips (same keys as ``payload_row``'s)."""
    return {"payload": {PAYLOAD: ""}, ERROR_KEY: error}


def _session(timeout_s: float):
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))


def _request_udf():
    """``HttpRequestUDF`` sending the JSON text as it is and timing each answer (defined lazily: Ray's LLM
    package is imported only where an endpoint is used)."""
    from ray.llm._internal.batch.stages.http_request_stage import HttpRequestUDF

    class EndpointRequestUDF(HttpRequestUDF):
        def _build_request(self, payload):
            return payload[PAYLOAD], self.json_headers

        async def udf(self, batch):
            started = time.perf_counter()
            try:
                async for row in super().udf(batch):
                    # The batch's requests go out together; each answer's time since then is its latency.
                    yield {**row, "endpoint_s": time.perf_counter() - started}
            except RuntimeError as exc:  # Ray's message quotes the whole payload (megabytes of frames)
                why = str(exc).rsplit("Previous Exception:", 1)[-1].split("Full Traceback", 1)[0].strip()
                raise EndpointUnavailable(
                    f"the endpoint {self.url} gave no answer after {self.max_retries + 1} tries: {why[:300]}"
                ) from None

    return EndpointRequestUDF


def build_processor(endpoint: Endpoint, preprocess, postprocess):
    """Ray Data LLM's HTTP processor for ``endpoint``'s chat completions, with ``EndpointRequestUDF``."""
    from ray.data.llm import HttpRequestProcessorConfig
    from ray.data.llm import build_processor as build

    config = HttpRequestProcessorConfig(
        url=f"{endpoint.url}/chat/completions",
        headers=endpoint.headers(),
        qps=endpoint.qps,
        max_retries=endpoint.retries,
        base_retry_wait_time_in_s=1,
        batch_size=endpoint.batch_size,
        concurrency=(endpoint.concurrency, endpoint.concurrency),  # all started with the job (an int: from 1)
        session_factory=functools.partial(_session, endpoint.timeout_s),
    )
    processor = build(config, preprocess=preprocess, postprocess=postprocess)
    processor.get_stage_by_name("HttpRequestStage").fn = _request_udf()
    # A request that never succeeds raises in the stage: the batch is tried as every engine stage's is, then dropped.
    return bounded_engine_retries(processor, "HttpRequestStage")


@dataclass
class Answer:
    text: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


def read_answer(row: dict[str, Any]) -> Answer:
    """A chat completion (or an error answer, or Ray's error row) as text, tokens and error."""
    if row.get(ERROR_KEY):
        return Answer(error=str(row[ERROR_KEY]))
    resp = row.get("http_response") or {}
    latency = float(row.get("endpoint_s") or 0.0)
    if resp.get("error"):
        err = resp["error"]
        message = err.get("message") if isinstance(err, dict) else err
        return Answer(latency_s=latency, error=f"endpoint error: {str(message)[:500]}")
    choices = resp.get("choices") or []
    if len(choices) == 0:
        return Answer(latency_s=latency, error=f"endpoint answer without choices: {json.dumps(resp)[:300]}")
    message = choices[0].get("message") or {}
    usage = resp.get("usage") or {}
    return Answer(
        text=(message.get("content") or "").strip(),
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
        latency_s=latency,
    )
