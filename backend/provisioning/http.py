"""The device-facing HTTP listener: OTA check, activation, firmware downloads (Starlette).

Routes (with `ota_path` = `/xiaozhi/ota/`; each with and without its trailing slash, since
stock firmware's HTTP client follows no redirect):

- `GET /xiaozhi/ota/`: a health text;
- `POST /xiaozhi/ota/`: the OTA check (§5.1) → the §5.2 answer;
- `POST /xiaozhi/ota/activate`: activation polling (§5.3) → 200 / 202 / 403 / 404;
- `POST /xiaozhi/ota/enroll/<code>/` and `.../enroll/<code>/activate`: the same, with an
  enrollment code in the device's OTA URL;
- `GET /xiaozhi/ota/firmware/<board>/<version>`: a published release, with Content-Length and
  `X-Firmware-SHA256`. The board and version only select a release by exact match; the file
  sent is that release's stored artifact (`FirmwareReleases.open`), never a path built from
  the request;
- `POST /vision/explain`: a camera board's photo upload (`backend.vision.http`, docs/vision.md).

OTA bodies are capped at 16 KiB (413) before they are parsed, and must arrive within
`device_http_body_timeout_s` (408); anything but a JSON object is 400. An answer given before
the body was read whole says `Connection: close` (the listener then drops the rest of the body
without a reset, `backend.provisioning.listener`). Concurrent connections are capped by the
listener (`device_http_max_connections`, 503 past it) and, per address, at accept by its
`ConnectionGuard`; an address whose requests keep being refused (429, a vision 401) is dropped
at accept for a while (the guard's penalty box).
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO

import structlog
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from backend.metrics import record_provisioning
from backend.provisioning.ota import MAX_BODY_BYTES
from backend.provisioning.service import Answer, Provisioning, refusal
from backend.transports.throttle import ExemptNetworks
from backend.vision.http import explain
from backend.vision.service import VISION_PATH

HEALTH_TEXT = "OTA endpoint of esp32-mcp-bridge: POST the device's system info here.\n"
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
log = structlog.get_logger("provisioning")


class _TooLarge(Exception):
    pass


def device_app(service: Provisioning) -> Starlette:
    """The Starlette app of the device-facing listener (routes in the module docstring)."""
    base = service.settings.ota_path  # always ends with "/"
    exempt = ExemptNetworks(service.settings.rate_limit_exempt)

    def refused_again(request: Request) -> None:
        """A refusal a stranger or a flood earned (429, a vision 401): too many from one
        address in a short while and the listener drops its connections at accept."""
        host = _host(request)
        if host is not None and host not in exempt:
            service.connections.handshake_refused(host)

    async def health(_request: Request) -> Response:
        return PlainTextResponse(HEALTH_TEXT)

    async def check(request: Request) -> Response:
        return await _handle(service, request, "ota", refused_again)

    async def activate(request: Request) -> Response:
        return await _handle(service, request, "activate", refused_again)

    async def download(request: Request) -> Response:
        found = service.download(
            request.path_params["board"], request.path_params["version"], _remote(request)
        )
        if isinstance(found, Answer):
            return _answer(found)
        try:
            reader = await run_in_threadpool(service.releases.open, found)
        except OSError as exc:
            log.warning("published firmware cannot be served", board=found.board, error=str(exc))
            return _answer(refusal(404, "no such firmware"))
        headers = {
            "Content-Length": str(found.size),
            "X-Firmware-SHA256": found.sha256,
            "ETag": f'"{found.sha256}"',
        }
        if request.method == "HEAD":
            reader.close()
            return Response(headers=headers, media_type="application/octet-stream")
        return StreamingResponse(
            _chunks(reader), media_type="application/octet-stream", headers=headers
        )

    async def vision(request: Request) -> Response:
        response = await explain(service.vision, request)
        if response.status_code in (401, 429):
            refused_again(request)
        return response

    routes = [Route(VISION_PATH, vision, methods=["POST"])]
    for prefix in (base, f"{base}enroll/{{code}}/"):
        routes += [
            Route(prefix, check, methods=["POST"]),
            Route(prefix.rstrip("/"), check, methods=["POST"]),
            Route(f"{prefix}activate", activate, methods=["POST"]),
            Route(f"{prefix}activate/", activate, methods=["POST"]),
        ]
    routes += [
        Route(base, health, methods=["GET"]),
        Route(base.rstrip("/"), health, methods=["GET"]),
        Route(f"{base}firmware/{{board}}/{{version}}", download, methods=["GET", "HEAD"]),
    ]
    return Starlette(routes=routes)


async def _chunks(reader: BinaryIO) -> AsyncIterator[bytes]:
    """The opened artifact, 64 KiB at a time, closed at the end or when the client goes."""
    try:
        while chunk := await run_in_threadpool(reader.read, 1 << 16):
            yield chunk
    finally:
        reader.close()


async def _handle(
    service: Provisioning, request: Request, kind: str, refused_again: Callable[[Request], None]
) -> Response:
    headers = request.headers
    identified = service.identify(
        kind,
        {
            "device_id": headers.get("device-id"),
            "client_id": headers.get("client-id"),
            "activation_version": headers.get("activation-version"),
            "serial_number": headers.get("serial-number"),
            "user_agent": headers.get("user-agent"),
            "accept_language": headers.get("accept-language"),
            "remote": _remote(request),
        },
    )
    if isinstance(identified, Answer):
        if identified.status == 429:
            refused_again(request)
        return _counted(kind, identified, close=True)  # its body is never read
    deadline = service.settings.device_http_body_timeout_s
    try:
        async with asyncio.timeout(deadline):
            body = await _json_body(request)
    except _TooLarge:
        return _counted(kind, refusal(413, f"body larger than {MAX_BODY_BYTES} bytes"), close=True)
    except TimeoutError:
        late = refusal(408, f"the body did not arrive within {deadline:g} s")
        return _counted(kind, late, close=True)
    except ClientDisconnect:
        return _counted(kind, refusal(400, "the client went away"), close=True)
    except (ValueError, RecursionError):
        return _counted(kind, refusal(400, "the body is not a JSON object"))
    enrollment = request.path_params.get("code")
    if kind == "ota":
        answer = await service.ota(
            identified,
            body,
            enrollment=enrollment,
            host=headers.get("host"),
        )
    else:
        answer = await service.activate(identified, body)
    return _counted(kind, answer)


def _counted(kind: str, answer: Answer, *, close: bool = False) -> Response:
    """The answer to an OTA check or activation poll, counted by outcome (docs/metrics.md).
    `close`: the body was not read whole, so the connection ends after the answer."""
    record_provisioning(kind, answer.status, activation_code="activation" in answer.body)
    response = _answer(answer)
    if close:
        response.headers["Connection"] = "close"
    return response


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    raw = b"".join(chunks).strip()
    if not raw:
        return {}
    value = json.loads(raw)  # ValueError (JSONDecodeError, UnicodeDecodeError) → 400
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def _host(request: Request) -> str | None:
    client = request.client
    return client.host if client is not None else None


def _remote(request: Request) -> str | None:
    client = request.client
    return f"{client.host}:{client.port}" if client is not None else None


def _answer(answer: Answer) -> Response:
    return Response(
        _JSON.encode(answer.body),
        status_code=answer.status,
        media_type="application/json",
        headers=answer.headers or None,
    )
