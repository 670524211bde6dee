"""A minimal HTTP/1.1 keep-alive client on asyncio streams, for latency benchmarks.

The same few lines serve every HTTP path of a benchmark (the baseline and the measured one), so
client overhead is equal on both sides and small next to httpx's.
"""

import asyncio


class KeepAliveHttp:
    def __init__(self, host: str, port: int, token: str) -> None:
        self.host = host
        self.port = port
        self.token = token
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "KeepAliveHttp":
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._writer is not None:
            self._writer.close()

    def prepare(self, method: str, path: str, body: bytes = b"") -> bytes:
        """The request bytes (built outside the timed region)."""
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\n"
            f"authorization: Bearer {self.token}\r\n"
        )
        if body:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        return head.encode() + b"\r\n" + body

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send prepared request bytes; (status, body) of the response."""
        assert self._reader is not None and self._writer is not None
        self._writer.write(request)
        status_line = await self._reader.readuntil(b"\r\n")
        length = 0
        while (line := await self._reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self._reader.readexactly(length)
        return int(status_line.split(b" ", 2)[1]), body
