"""The photo upload of a stock xiaozhi-esp32 camera board (`self.camera.take_photo`, protocol
reference §4.5), byte for byte over a raw socket: what tests and the benchmark send.

The firmware opens `POST <vision url>` with `Device-Id`, `Client-Id`, `Authorization: Bearer
<token>` (when it has one), `Content-Type: multipart/form-data; boundary=----ESP32_CAMERA_BOUNDARY`
and `Transfer-Encoding: chunked`, then writes one chunk per `Write`: the question field, the file
part's head, the JPEG as the encoder hands it out, the closing boundary, and the empty chunk.
"""

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

BOUNDARY = "----ESP32_CAMERA_BOUNDARY"
JPEG_CHUNK = 4096  # the size of the pieces the JPEG encoder's callback writes


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def fake_jpeg(size: int) -> bytes:
    """`size` bytes that start and end like a JPEG (SOI + JFIF APP0, ..., EOI)."""
    head = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    return head + os.urandom(max(0, size - len(head) - 2)) + b"\xff\xd9"


def stock_parts(question: str, image: bytes, chunk: int = JPEG_CHUNK) -> list[bytes]:
    """The body's pieces, one per firmware `Write` (each goes out as one HTTP chunk)."""
    question_field = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="question"\r\n\r\n{question}\r\n'
    ).encode()
    file_header = (
        f"--{BOUNDARY}\r\n"
        'Content-Disposition: form-data; name="file"; filename="camera.jpg"\r\n'
        "Content-Type: image/jpeg\r\n"
        "\r\n"
    ).encode()
    footer = f"\r\n--{BOUNDARY}--\r\n".encode()
    pieces = [image[i : i + chunk] for i in range(0, len(image), chunk)]
    return [question_field, file_header, *pieces, footer]


def stock_head(
    url: str,
    *,
    device_id: str,
    client_id: str,
    token: str | None,
    extra: dict[str, str] | None = None,
) -> bytes:
    parts = urlsplit(url)
    headers = {
        "Host": parts.netloc,
        "User-Agent": "bread-compact-wifi/2.4.2",
        "Device-Id": device_id,
        "Client-Id": client_id,
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        "Transfer-Encoding": "chunked",
    }
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    headers.update(extra or {})
    lines = [f"POST {parts.path or '/'} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(pieces: Iterable[bytes], *, last: bool = True) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces if piece)
    return out + (b"0\r\n\r\n" if last else b"")


async def stock_upload(
    url: str,
    *,
    device_id: str,
    client_id: str,
    token: str | None,
    question: str,
    image: bytes,
) -> HttpAnswer:
    """Upload as the firmware does and read the answer."""
    head = stock_head(url, device_id=device_id, client_id=client_id, token=token)
    return await send_raw(url, head, _each(stock_parts(question, image)))


async def _each(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield chunked([piece], last=False)
    yield b"0\r\n\r\n"


async def send_raw(url: str, head: bytes, body: AsyncIterator[bytes]) -> HttpAnswer:
    """Send `head` then `body`'s pieces (a refusal mid-body stops the sending, not the read),
    then read one HTTP/1.1 answer (Content-Length or chunked)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    try:
        writer.write(head)
        sending = asyncio.create_task(_pump(writer, body))
        answer = await read_answer(reader)
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        return answer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _pump(writer: asyncio.StreamWriter, body: AsyncIterator[bytes]) -> None:
    async for piece in body:
        writer.write(piece)
        await writer.drain()


async def read_answer(reader: asyncio.StreamReader) -> HttpAnswer:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed before an answer")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += await reader.readexactly(size)
            await reader.readline()
    else:
        body = await reader.read()
    return HttpAnswer(status, headers, body)
