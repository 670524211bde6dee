"""`POST /vision/explain` on the device-facing HTTP listener (mounted by
`backend.provisioning.http.device_app`).

The body is read as it arrives: refused at once when its Content-Length is over the cap, and at
the chunk that crosses the cap when it is chunked (stock firmware sends it chunked), so no more
than `vision_max_bytes` is ever held. A body that stalls is given up after `BODY_DEADLINE_S`.
Every refusal closes the connection (stock firmware opens one per photo).
"""

import asyncio
import json
import time

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from backend.vision.service import VisionAnswer, VisionService, refused
from backend.vision.upload import Upload, UploadError, UploadReader

BODY_DEADLINE_S = 30.0  # a 2 MB photo over a slow Wi-Fi link takes a few seconds
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


async def explain(service: VisionService, request: Request) -> Response:
    """Handle `POST /vision/explain`: admit, read the bounded upload, ask the model, audit the
    upload."""
    started = time.monotonic()
    headers = request.headers
    client = request.client
    admitted = service.admit(
        {
            "device_id": headers.get("device-id"),
            "client_id": headers.get("client-id"),
            "authorization": headers.get("authorization"),
        },
        f"{client.host}:{client.port}" if client is not None else None,
    )
    remote = f"{client.host}:{client.port}" if client is not None else None
    if isinstance(admitted, VisionAnswer):
        service.record(
            admitted.device_id,
            question="",
            size=0,
            answer=admitted,
            started=started,
            authenticated=admitted.authenticated,
            remote=remote,
        )
        return _response(admitted)
    read, size = await _read_upload(request, service.max_bytes)
    if isinstance(read, VisionAnswer):
        answer, question = read, ""
    else:
        answer, question = await service.explain(admitted, read), read.question
    service.record(
        admitted.device_id,
        question=question,
        size=size,
        answer=answer,
        started=started,
        remote=remote,
    )
    return _response(answer)


async def _read_upload(request: Request, max_bytes: int) -> tuple[Upload | VisionAnswer, int]:
    """The upload, or the refusal; and the body bytes read."""
    reader: UploadReader | None = None
    try:
        reader = UploadReader(request.headers.get("content-type"), max_bytes)
        _check_declared(request.headers.get("content-length"), max_bytes)
        async with asyncio.timeout(BODY_DEADLINE_S):
            async for chunk in request.stream():
                reader.feed(chunk)
        upload: Upload | VisionAnswer = reader.finish()
    except UploadError as exc:
        upload = refused(exc.status, exc.message)
    except TimeoutError:
        upload = refused(408, f"the upload did not arrive within {BODY_DEADLINE_S:g} s")
    except ClientDisconnect:
        upload = refused(400, "the device went away during the upload")  # for the audit
    return upload, reader.size if reader is not None else 0


def _response(answer: VisionAnswer) -> Response:
    headers = dict(answer.headers)
    if answer.status != 200:
        # The rest of a refused body may still be coming: without this, the connection would
        # read (and drop) it until it ends, holding a slot of the listener meanwhile.
        headers["Connection"] = "close"
    return Response(
        _JSON.encode(answer.body),
        status_code=answer.status,
        media_type="application/json",
        headers=headers,
    )


def _check_declared(declared: str | None, max_bytes: int) -> None:
    if declared is None:
        return
    if not declared.strip().isdigit():
        raise UploadError(400, "malformed Content-Length")
    if int(declared) > max_bytes:
        raise UploadError(413, f"the upload is larger than {max_bytes} bytes")
