"""What the HTTP providers share: one httpx client, the request body, error mapping, line
streaming, and one retry on a fresh connection.

The retry: model servers (llama.cpp's among them) close a kept-alive connection after a streamed
reply without saying so; the next request on that pooled connection fails before any byte of an
answer (`RemoteProtocolError`, `ReadError`). A model call sends nothing that changes state, so it
is sent once more, on a connection of its own. A timeout is not retried (the model is slow, not
gone), nor is anything after the answer began.

A service that fails is logged through `health` (`backend.chat.health.Reachability`): a warning
when it starts failing or fails in a new way, debug while it stays down, a warning when it
answers again; the error it raises is marked `reported`, so the turn that meets it does not log
it again. Its text is a short reason ("ollama unreachable at http://localhost:11434"), the
transport's own words go to the log only (`LlmError.detail`).
"""

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import httpx
import structlog

from backend.chat.errors import LlmError, LlmUnavailable
from backend.chat.health import Reachability, quiet_libraries
from backend.chat.llm.base import FunctionSpec, Message, Sampling, Usage
from backend.common import clip

log = structlog.get_logger("chat.llm")
quiet_libraries()  # httpx logs every request at INFO: debug detail here
_E = TypeVar("_E", bound=LlmError)


class HttpProvider:
    """Base of the OpenAI-compatible and Ollama providers (never logs the API key)."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        models: Usage,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.models = models
        self.health = Reachability(log, "chat model", provider=self.name, url=self.base_url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)
        # For the one retry: no pooled connection, so never the one that just failed.
        self._fresh = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def aclose(self) -> None:
        """Close both HTTP clients."""
        await self._client.aclose()
        await self._fresh.aclose()

    def body(
        self,
        messages: Sequence[Message],
        model: str | None,
        tools: Sequence[FunctionSpec],
        sampling: Sampling,
        stream: bool,
    ) -> dict[str, Any]:
        """The request both wire formats share (Ollama takes OpenAI's tool declarations);
        `wire_message` and `add_options` are what differs."""
        body: dict[str, Any] = {
            "model": model or self.models.chat,
            "messages": [self.wire_message(message) for message in messages],
            "stream": stream,
        }
        if tools:
            body["tools"] = [wire_tool(spec) for spec in tools]
        self.add_options(body, bool(tools), sampling)
        return body

    @staticmethod
    def wire_message(message: Message) -> dict[str, Any]:
        """A message in the provider's wire format (each provider has its own)."""
        raise NotImplementedError

    def add_options(self, body: dict[str, Any], tools: bool, sampling: Sampling) -> None:
        """Add the provider's tool and sampling options to a request body."""
        raise NotImplementedError

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST a JSON body (with retry), return the JSON answer; raises LlmError."""
        try:
            response = await self._send_with_retry(url, body, stream=False)
            await response.aread()
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        return self._json_of(response)

    async def get_json(self, url: str) -> Any:
        """GET a listing (no retry needed: nothing was sent that a dropped connection loses
        beyond this request, and the console asks again on its next load)."""
        try:
            response = await self._client.get(url)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        return self._json_of(response)

    def _json_of(self, response: httpx.Response) -> Any:
        """The body of a read reply as JSON; LlmError for an error status or another body."""
        self._check_status(response.status_code, response.text)
        try:
            return response.json()
        except ValueError:
            raise LlmError(f"{self.name}: the reply is not JSON") from None

    @contextlib.asynccontextmanager
    async def post_lines(self, url: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        """POST and yield the reply's lines as they arrive (SSE or NDJSON)."""
        try:
            response = await self._send_with_retry(url, body, stream=True)
            try:
                if response.status_code >= 400:
                    await response.aread()
                    self._check_status(response.status_code, response.text)
                self.health.answered()
                yield self._lines(response)
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None

    async def _send_with_retry(
        self, url: str, body: dict[str, Any], *, stream: bool
    ) -> httpx.Response:
        request = self._client.build_request("POST", url, json=body)
        try:
            return await self._client.send(request, stream=stream)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            log.info(
                "llm connection dropped, one retry", provider=self.name, error=type(exc).__name__
            )
            request = self._fresh.build_request("POST", url, json=body)
            return await self._fresh.send(request, stream=stream)

    async def _lines(self, response: httpx.Response) -> AsyncIterator[str]:
        async for line in response.aiter_lines():
            if line:
                yield line

    def _unreachable(self, exc: httpx.HTTPError) -> LlmUnavailable:
        """The transport failed: a short reason, the transport's words as `detail`."""
        detail = clip(f"{type(exc).__name__}: {exc}", 200)
        where = f"{self.name} at {self.base_url}"
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            kind, reason = "unreachable", f"{self.name} unreachable at {self.base_url}"
        elif isinstance(exc, httpx.TimeoutException):
            kind, reason = "timeout", f"{where} did not answer in time ({type(exc).__name__})"
        else:  # a dropped connection, a malformed answer, a URL httpx cannot use
            kind, reason = type(exc).__name__, f"{where} failed: {detail}"
        error = LlmUnavailable(reason)
        error.detail = detail
        return self._failed(error, kind)

    def _check_status(self, status: int, text: str) -> None:
        """Nothing for a good status (the service answers); else raise why, reported once."""
        if status < 400:
            self.health.answered()
            return
        said = clip(text, 160)
        error: LlmError
        if status >= 500:
            error = LlmUnavailable(f"{self.name} answered HTTP {status}: {said}")
        elif status == 401:  # the one the user must fix: say what
            error = LlmError(
                f"{self.name} refused the API key (HTTP 401; check llm_api_key): {said}"
            )
        else:
            error = LlmError(f"{self.name} refused the request (HTTP {status}): {said}")
        raise self._failed(error, f"HTTP {status}")

    def _failed(self, error: _E, kind: str) -> _E:
        """`error`, logged through `health` and marked `reported`."""
        fields = {"detail": error.detail} if error.detail else {}
        self.health.failed(kind, str(error), **fields)
        error.reported = True
        return error


def model_names(items: Any, key: str) -> list[str]:
    """The `key` of each object in a listing, as text, sorted and without duplicates; anything
    else in the listing is skipped (servers add their own fields and entries)."""
    if not isinstance(items, list):
        raise LlmError("the model listing is not a list")
    names = {
        item[key] for item in items if isinstance(item, dict) and isinstance(item.get(key), str)
    }
    return sorted(name for name in names if name)


def wire_tool(spec: FunctionSpec) -> dict[str, Any]:
    """A function spec as an OpenAI/Ollama `tools` entry."""
    return {
        "type": "function",
        "function": {
            "name": spec.llm_name,
            "description": spec.description,
            "parameters": spec.parameters,
        },
    }
