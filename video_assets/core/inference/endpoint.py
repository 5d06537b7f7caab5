"""Any OpenAI-compatible chat endpoint as an engine (``VLM_ENGINE=endpoint``): a vLLM server a user already
runs, or a hosted VLM API. One chat completion per row, sent by ``EndpointRequests``, a Ray Data actor stage
(``map_batches``, public API) that sends a batch's requests concurrently and answers for each row on its own:

- every try has one total deadline (``timeout_s``, VLM_REQUEST_TIMEOUT_S); a request that used it up is not
  tried again (a stalled replica would cost the same again), its row names the timeout;
- 429 / 408 / 5xx and dropped connections are tried ``retries`` more times with exponential backoff
  (honouring ``Retry-After``, capped); other 4xx are the row's error at once;
- an answer larger than ``max_answer_bytes`` is refused while it is read (never buffered whole), and an
  answer that is not JSON is the row's error, quoted briefly;
- the other rows of the batch keep their answers: one bad request never costs its neighbours.

Ray Data LLM's HTTP processor (``HttpRequestProcessorConfig``) raises for the whole batch when one request
fails, has no size cap, and retries a timeout; hence this stage (docs/captioning.md).

The payload travels through Ray Data as JSON text, and so does the answer: as a column, Arrow would unify
the content parts' (text / image) and the JSON schemas' structs, filling every missing key with null, which
servers refuse. The API key goes in the request header only: never in a row, a log line, a repr or the registry."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from video_assets.core.inference.retries import VLM_BATCH_RETRIES
from video_assets.core.inference.vllm import ERROR_KEY  # the error column every engine stage's rows carry

SETTING = "VLM_ENDPOINT_URL"
PAYLOAD = "payload_json"
RESPONSE = "response_json"
# Larger than any caption or structured answer (a few KB) by far; a server that sends more is broken or hostile.
MAX_ANSWER_BYTES = 1_000_000
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0


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
    qps: int | None = None  # requests per second per request-stage actor; None: as fast as answered
    timeout_s: float = 120.0  # per try, connect to last byte; a timed-out request is not tried again
    retries: int = VLM_BATCH_RETRIES  # more tries after a 429 / 408 / 5xx / dropped connection
    batch_size: int = 4
    concurrency: int = 1  # request stage actors (each sends its batch's requests concurrently)
    max_answer_bytes: int = MAX_ANSWER_BYTES
    video: bool = False  # takes a video part (vLLM's server): captions send the in-job engines' request

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
    """A row's request columns: the body as JSON text (see the module docstring), no error."""
    return {PAYLOAD: json.dumps(payload), ERROR_KEY: ""}


def error_row(error: str) -> dict[str, Any]:
    """A row the request stage skips (the same columns as ``payload_row``'s)."""
    return {PAYLOAD: "", ERROR_KEY: error}


class _Failed(Exception):
    def __init__(self, reason: str, retry: bool = False, wait_s: float | None = None):
        super().__init__(reason)
        self.reason, self.retry, self.wait_s = reason, retry, wait_s


def _retry_after(value: str | None) -> float | None:
    try:
        return min(MAX_BACKOFF_S, max(0.0, float(value))) if value else None
    except ValueError:
        return None  # an HTTP date: the exponential backoff instead


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        return str(message or "")[:300]
    except Exception:
        return body[:200].decode("utf-8", "replace")


class EndpointRequests:
    """The request stage (a Ray Data actor class, ``map_batches``): each row's ``PAYLOAD`` posted to the
    endpoint's chat completions, its answer in ``RESPONSE`` (JSON text), or its reason in ``ERROR_KEY``; the
    seconds from the batch's start to each answer in ``endpoint_s``. Never raises for a request."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.url = f"{endpoint.url}/chat/completions"
        self._session = None
        self._next_start = 0.0  # the QPS limit: when the next request may start (this actor's)

    async def __call__(self, batch: dict) -> dict:
        import aiohttp

        if self._session is None:  # made on the actor's event loop
            self._session = aiohttp.ClientSession(
                headers={**self.endpoint.headers(), "Content-Type": "application/json"}
            )
        started = time.perf_counter()

        async def one(payload, error) -> tuple[str, str, float]:
            if error:  # the CPU stage's error row, or a payload that could not be built
                return "", str(error), 0.0
            try:
                answer = await self._send(str(payload))
                return answer, "", time.perf_counter() - started
            except _Failed as exc:
                return "", exc.reason, time.perf_counter() - started

        done = await asyncio.gather(*(one(p, e) for p, e in zip(batch[PAYLOAD], batch[ERROR_KEY])))
        out = dict(batch)
        out[PAYLOAD] = [""] * len(done)  # the frames are sent: not carried on in a second copy
        out[RESPONSE] = [d[0] for d in done]
        out[ERROR_KEY] = [d[1] for d in done]
        out["endpoint_s"] = [d[2] for d in done]
        return out

    async def _send(self, body: str) -> str:
        tries = 1 + max(0, self.endpoint.retries)
        for attempt in range(1, tries + 1):
            await self._pace()
            try:
                return await self._try(body)
            except _Failed as exc:
                if not exc.retry or attempt == tries:
                    if exc.retry:
                        raise _Failed(f"{exc.reason} (after {tries} tries)") from None
                    raise
                await asyncio.sleep(exc.wait_s if exc.wait_s is not None else min(MAX_BACKOFF_S, 2.0 ** (attempt - 1)))
        raise AssertionError("unreachable")

    async def _pace(self) -> None:
        if not self.endpoint.qps:
            return
        now = time.monotonic()
        start = max(now, self._next_start)
        self._next_start = start + 1.0 / self.endpoint.qps
        await asyncio.sleep(start - now)

    async def _try(self, body: str) -> str:
        import aiohttp

        cap = self.endpoint.max_answer_bytes
        timeout = aiohttp.ClientTimeout(total=self.endpoint.timeout_s)
        try:
            async with self._session.post(self.url, data=body, timeout=timeout, allow_redirects=False) as resp:
                if (resp.content_length or 0) > cap:
                    raise _Failed(f"oversized answer: {resp.content_length} bytes, more than max_answer_bytes={cap}")
                data = bytearray()
                async for chunk in resp.content.iter_chunked(65536):
                    data += chunk
                    if len(data) > cap:
                        raise _Failed(f"oversized answer: more than max_answer_bytes={cap} bytes")
                status = resp.status
                if status in RETRY_STATUS:
                    what = "rate limited" if status == 429 else "endpoint unavailable"
                    wait = _retry_after(resp.headers.get("Retry-After"))
                    raise _Failed(f"{what}: HTTP {status} {_error_message(bytes(data))}".strip(), True, wait)
                if status != 200:
                    raise _Failed(f"endpoint error: HTTP {status} {_error_message(bytes(data))}".strip())
        except TimeoutError:
            raise _Failed(
                f"timed out: no whole answer within {self.endpoint.timeout_s:g} s (VLM_REQUEST_TIMEOUT_S)"
            ) from None
        except aiohttp.ClientError as exc:
            raise _Failed(f"connection failed: {exc.__class__.__name__}: {str(exc)[:200]}", True) from None
        try:
            json.loads(data)
        except ValueError:
            raise _Failed(f"unparsable answer (not JSON): {bytes(data[:120])!r}") from None
        return data.decode("utf-8", "replace")


def request_stage(ds, endpoint: Endpoint, preprocess, postprocess):
    """``ds`` through ``preprocess`` (a row's request: ``payload_row`` / ``error_row``, merged into the row),
    ``EndpointRequests`` and ``postprocess`` (the row with its answer), on public Ray Data APIs only."""
    import ray.data

    from video_assets.core.inference.retries import engine_stage_options

    return (
        ds.map(lambda row: {**row, **preprocess(row)})
        .map_batches(
            EndpointRequests,
            fn_constructor_args=(endpoint,),
            batch_size=endpoint.batch_size,
            compute=ray.data.ActorPoolStrategy(size=endpoint.concurrency),
            num_cpus=0,  # it waits on the endpoint; the CPU stages and the server do the work
            # A lost actor (its node gone) comes back and its batch is sent again, a bounded number of times.
            **engine_stage_options(),
        )
        .map(postprocess)
    )


@dataclass
class Answer:
    text: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None

    def caption_error(self, server: str) -> str | None:
        """The error of a caption from this answer: its own, or none from an empty answer (``server`` says who)."""
        return self.error or (None if self.text else f"{server} answered with no text")


def read_answer(row: dict[str, Any]) -> Answer:
    """A chat completion (or an error answer, or Ray's error row) as text, tokens and error."""
    latency = float(row.get("endpoint_s") or 0.0)
    if row.get(ERROR_KEY):
        return Answer(latency_s=latency, error=str(row[ERROR_KEY]))
    resp = json.loads(row[RESPONSE]) if row.get(RESPONSE) else {}
    if not isinstance(resp, dict):
        return Answer(latency_s=latency, error=f"unparsable answer (not a JSON object): {str(resp)[:120]}")
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
