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

from starlette.requests import Request
from starlette.responses import Response

from backend.vision.service import VisionAnswer, VisionService, refused
from backend.vision.upload import UploadError, UploadReader

BODY_DEADLINE_S = 30.0  # a 2 MB photo over a slow Wi-Fi link takes a few seconds
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


async def explain(service: VisionService, request: Request) -> Response:
    started = time.monotonic()
    headers = request.headers
    client = request.client
    remote = f"{client.host}:{client.port}" if client is not None else None
    admitted = service.admit(
        {
            "device_id": headers.get("device-id"),
            "client_id": headers.get("client-id"),
            "authorization": headers.get("authorization"),
        },
        remote,
    )
    question, size = "", 0
    if isinstance(admitted, VisionAnswer):
        device_id, answer = admitted.device_id, admitted
    else:
        device_id = admitted.device_id
        reader: UploadReader | None = None
        try:
            reader = UploadReader(headers.get("content-type"), service.max_bytes)
            _check_declared(headers.get("content-length"), service.max_bytes)
            async with asyncio.timeout(BODY_DEADLINE_S):
                async for chunk in request.stream():
                    reader.feed(chunk)
            upload = reader.finish()
        except UploadError as exc:
            answer = refused(exc.status, exc.message)
        except TimeoutError:
            answer = refused(408, f"the upload did not arrive within {BODY_DEADLINE_S:g} s")
        else:
            question = upload.question
            answer = await service.explain(admitted, upload)
        size = reader.size if reader is not None else 0
    service.record(device_id, question=question, size=size, answer=answer, started=started)
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
