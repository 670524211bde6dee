"""Minimal RFC 6455 WebSocket client on asyncio streams; the same code runs on MicroPython and
CPython (the desktop simulator runs a thousand of these in one process).

Behaves like the stock firmware's client (protocol reference §1.1): `Host` without the port,
every frame masked, server pings answered, no pings sent, fragmented messages reassembled,
outgoing frames limited to 65 535 bytes. Unlike stock it checks `Sec-WebSocket-Accept` where
hashlib.sha1 exists (CPython, unix port, ESP32), so a non-WebSocket server is caught at once.
ws:// only: TLS needs a CA bundle and ~20 KB of IDF heap on the device, so wss:// raises.

The framing is pure functions (frame_parts/frame_chunks/build_frame, header_size/parse_header,
parse_frame, parse_url, handshake_request) so it can be tested without sockets on every runtime.
"""

import asyncio
import os
import struct

from compat import const, mask

OP_CONTINUATION = const(0)
OP_TEXT = const(1)
OP_BINARY = const(2)
OP_CLOSE = const(8)
OP_PING = const(9)
OP_PONG = const(10)
_OPCODES = (OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG)

CLOSE_NORMAL = const(1000)
CLOSE_PROTOCOL_ERROR = const(1002)
CLOSE_INVALID_DATA = const(1007)
CLOSE_TOO_BIG = const(1009)

MAX_SEND = const(65535)  # stock client limit; larger sends fail rather than fragment
JOIN_MAX = const(4096)  # frames with a body up to this size go out in one write (frame_chunks)
MAX_FRAME = const(65536)
_MAX_RESPONSE_LINES = const(64)
_CLOSE_TIMEOUT_S = 2
_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

_CONNECTING = const(0)
_OPEN = const(1)
_CLOSING = const(2)
_CLOSED = const(3)


class ProtocolError(ValueError):
    """The server broke RFC 6455; the link is failed with `close_code`."""

    def __init__(self, message, close_code=CLOSE_PROTOCOL_ERROR):
        super().__init__(message)
        self.close_code = close_code


class HandshakeError(ValueError):
    """The server answered the upgrade with something other than 101 (e.g. 401)."""

    def __init__(self, status, line=""):
        super().__init__("rejected: HTTP " + str(status) + (" (" + line + ")" if line else ""))
        self.status = status


# ---- pure helpers ---------------------------------------------------------------------------


def parse_url(url):
    """(host, port, path) of ws://host[:port][/path][?query]; ValueError for anything else."""
    if not isinstance(url, str):
        raise ValueError("WebSocket URL must be a string")
    cut = url.find("://")
    if cut < 0:
        raise ValueError("bad WebSocket URL (expected ws://host[:port]/path): " + url)
    scheme = url[:cut].lower()
    if scheme == "wss":
        raise ValueError("TLS not supported on this build: use ws:// instead of " + url)
    if scheme != "ws":
        raise ValueError("unsupported URL scheme " + scheme + ":// (only ws://): " + url)
    rest = url[cut + 3 :]
    end = len(rest)
    for separator in "/?#":
        found = rest.find(separator)
        if 0 <= found < end:
            end = found
    authority, path = rest[:end], rest[end:]
    hash_at = path.find("#")
    if hash_at >= 0:
        path = path[:hash_at]
    if not path.startswith("/"):
        path = "/" + path
    host, port = _split_authority(authority, url)
    if " " in path or not _printable(path):
        raise ValueError("bad characters in WebSocket URL path: " + url)
    return host, port, path


def _split_authority(authority, url):
    if "@" in authority or "[" in authority:
        raise ValueError("user info and IPv6 literals are not supported: " + url)
    host, port = authority, 80
    colon = authority.rfind(":")
    if colon >= 0:
        host, digits = authority[:colon], authority[colon + 1 :]
        if not digits.isdigit() or not 0 < int(digits) < 65536:
            raise ValueError("bad port in WebSocket URL: " + url)
        port = int(digits)
    if not host or not _printable(host) or " " in host:
        raise ValueError("missing or bad host in WebSocket URL: " + url)
    return host, port


def _printable(text) -> bool:
    for char in text:
        if ord(char) < 32 or ord(char) == 127:
            return False
    return True


def handshake_request(host, path, key, headers) -> bytes:
    """The HTTP upgrade request; ValueError if a header would break the request."""
    lines = [
        "GET " + path + " HTTP/1.1",
        "Host: " + host,
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: " + key,
        "Sec-WebSocket-Version: 13",
    ]
    for name in headers:
        value = str(headers[name])
        if not name or ":" in name or not _printable(name) or not _printable(value):
            raise ValueError("bad WebSocket header " + repr(name) + ": " + repr(value))
        lines.append(name + ": " + value)
    lines.append("\r\n")
    return "\r\n".join(lines).encode()


def accept_value(key):
    """Sec-WebSocket-Accept expected for key, or None where the runtime lacks sha1."""
    try:
        from binascii import b2a_base64
        from hashlib import sha1
    except ImportError:
        return None
    return b2a_base64(sha1((key + _GUID).encode()).digest()).decode().strip()


def new_key() -> str:
    """A fresh base64 Sec-WebSocket-Key (16 random bytes)."""
    from binascii import b2a_base64

    return b2a_base64(random_bytes(16)).decode().strip()


def random_bytes(count) -> bytes:
    urandom = getattr(os, "urandom", None)
    if urandom is not None:
        return urandom(count)
    import random  # the wasm port has no os.urandom

    return bytes(random.getrandbits(8) for _ in range(count))


def frame_parts(opcode, payload, mask_key=None):
    """(header, body) of one final frame; masked when mask_key (4 bytes) is given."""
    size = len(payload)
    first = 0x80 | opcode
    mask_bit = 0x80 if mask_key is not None else 0
    if size < 126:
        head = struct.pack(">BB", first, mask_bit | size)
    elif size < 65536:
        head = struct.pack(">BBH", first, mask_bit | 126, size)
    else:
        head = struct.pack(">BBQ", first, mask_bit | 127, size)
    if mask_key is None:
        return head, payload
    return head + mask_key, mask(payload, mask_key)


def frame_chunks(opcode, payload, mask_key=None):
    """The writes that send one frame: (frame,) up to JOIN_MAX bytes of body, else (head, body).

    MicroPython's stream writer sends every write at once, so a small body written after its
    header is held back by Nagle until the peer ACKs the header, which a Linux peer delays by
    ~40 ms: every reply would wait that long. A larger body is not copied (RAM); it spans
    several full TCP segments, which Nagle does not hold back.
    """
    head, body = frame_parts(opcode, payload, mask_key)
    if len(body) <= JOIN_MAX:
        return (head + body,)
    return head, body


def build_frame(opcode, payload, mask_key=None) -> bytes:
    head, body = frame_parts(opcode, payload, mask_key)
    return head + body


def header_size(second_byte) -> int:
    """Bytes in a frame header, known from its second byte (length code and mask bit)."""
    size = 2
    length_code = second_byte & 0x7F
    if length_code == 126:
        size += 2
    elif length_code == 127:
        size += 8
    if second_byte & 0x80:
        size += 4
    return size


def parse_header(head):
    """(fin, opcode, payload_length, mask_key or None) of a complete frame header."""
    first, second = head[0], head[1]
    if first & 0x70:
        raise ProtocolError("frame with reserved bits set (no extension was negotiated)")
    opcode = first & 0x0F
    if opcode not in _OPCODES:
        raise ProtocolError("unknown frame opcode " + str(opcode))
    fin = bool(first & 0x80)
    length = second & 0x7F
    offset = 2
    if length == 126:
        length = struct.unpack_from(">H", head, 2)[0]
        offset = 4
    elif length == 127:
        length = struct.unpack_from(">Q", head, 2)[0]
        offset = 10
        if length >> 63:
            raise ProtocolError("frame length with the top bit set")
    if opcode >= OP_CLOSE and (length > 125 or not fin):
        raise ProtocolError("control frame fragmented or longer than 125 bytes")
    mask_key = bytes(head[offset : offset + 4]) if second & 0x80 else None
    return fin, opcode, length, mask_key


def parse_frame(data):
    """(fin, opcode, payload, bytes_used) of the first frame in data, None if incomplete."""
    if len(data) < 2:
        return None
    size = header_size(data[1])
    if len(data) < size:
        return None
    fin, opcode, length, mask_key = parse_header(data[:size])
    end = size + length
    if len(data) < end:
        return None
    payload = data[size:end]
    if mask_key is not None:
        payload = mask(payload, mask_key)
    return fin, opcode, bytes(payload), end


def close_code_of(payload):
    """Status code of a close frame payload (1005 = none given)."""
    if len(payload) < 2:
        return 1005
    return struct.unpack_from(">H", payload, 0)[0]


# ---- the client ------------------------------------------------------------------------------


class WsTransport:
    """One WebSocket link. receive() must be called by one task at a time; send() by any."""

    def __init__(self, url, headers, max_frame=MAX_FRAME, timeout_s=10):
        self.url = url
        self.headers = headers
        self.max_frame = max_frame
        self.timeout_s = timeout_s
        self.close_code = None  # the server's close code once it closed the link
        self._state = _CONNECTING
        self._reader = None
        self._writer = None
        self._send_lock = asyncio.Lock()
        self._reading = False
        self._closed_event = None

    @property
    def is_open(self) -> bool:
        return self._state == _OPEN

    async def connect(self):
        """Open TCP and upgrade; OSError for network trouble, ValueError for a bad URL/reply."""
        host, port, path = parse_url(self.url)
        key = new_key()
        request = handshake_request(host, path, key, self.headers)
        try:
            await asyncio.wait_for(self._handshake(host, port, request, key), self.timeout_s)
        except asyncio.TimeoutError:
            await self._abort()
            raise OSError("WebSocket handshake with " + host + ":" + str(port) + " timed out")
        except BaseException:
            await self._abort()
            raise

    async def _handshake(self, host, port, request, key):
        self._reader, self._writer = await asyncio.open_connection(host, port)
        self._check_not_closed()
        self._writer.write(request)
        await self._writer.drain()
        accept = await self._read_response()
        expected = accept_value(key)
        if expected is not None and accept != expected:
            raise ValueError("bad Sec-WebSocket-Accept in the upgrade response")
        self._check_not_closed()
        self._state = _OPEN

    def _check_not_closed(self):
        if self._state != _CONNECTING:  # close() was called during the handshake
            raise OSError("WebSocket closed during the handshake")

    async def _read_response(self):
        """Sec-WebSocket-Accept of a 101 response; HandshakeError for any other status."""
        status_line = await self._read_line()
        if not status_line.startswith("HTTP/1.1 ") or not status_line[9:12].isdigit():
            raise ValueError("not an HTTP response to the upgrade: " + repr(status_line[:60]))
        status = int(status_line[9:12])
        if status != 101:
            raise HandshakeError(status, status_line[13:60])
        accept = None
        for _ in range(_MAX_RESPONSE_LINES):
            line = await self._read_line()
            if not line:
                return accept
            colon = line.find(":")
            if colon > 0 and line[:colon].strip().lower() == "sec-websocket-accept":
                accept = line[colon + 1 :].strip()
        raise ValueError("upgrade response has too many header lines")

    async def _read_line(self) -> str:
        line = await self._stream().readline()
        if not line:
            raise OSError("connection closed during the WebSocket handshake")
        try:
            return str(line, "utf-8").strip()
        except UnicodeError:
            raise ValueError("upgrade response is not text")

    async def send(self, message):
        """Send str as a text frame, bytes as a binary frame (at most 65 535 bytes)."""
        if isinstance(message, str):
            opcode, data = OP_TEXT, message.encode()
        else:
            opcode, data = OP_BINARY, message
        if len(data) > MAX_SEND:
            raise ValueError(
                "outgoing message of " + str(len(data)) + " bytes exceeds the 65535-byte limit"
            )
        if self._state != _OPEN:
            raise OSError("WebSocket is not open")
        await self._write_frame(opcode, data)

    async def _write_frame(self, opcode, payload):
        chunks = frame_chunks(opcode, payload, random_bytes(4))
        async with self._send_lock:
            writer = self._writer
            if writer is None:
                raise OSError("WebSocket is closed")
            # No await between the writes, so frames never interleave.
            for chunk in chunks:
                writer.write(chunk)
            await writer.drain()

    async def receive(self):
        """Next message (str for text, bytes for binary), or None once the link is closed.

        Pings are answered here. A frame or message over max_frame, or any other protocol
        violation, fails the link (close frame with the reason code) and raises ProtocolError.
        """
        if self._state not in (_OPEN, _CLOSING) or self._reading:  # closed, or close() drains
            return None
        self._reading = True
        try:
            return await self._receive_message()
        except ProtocolError as error:
            self._reading = False  # close() below must drain the socket itself
            await self.close(error.close_code)
            raise
        except (OSError, EOFError):  # EOFError covers CPython's IncompleteReadError
            await self._abort()
            return None
        finally:
            self._reading = False

    async def _receive_message(self):
        fragments = None
        first_opcode = OP_TEXT
        while True:
            fin, opcode, payload = await self._read_frame()
            if opcode >= OP_CLOSE:
                if await self._handle_control(opcode, payload):
                    return None
                continue
            if opcode == OP_CONTINUATION:
                if fragments is None:
                    raise ProtocolError("continuation frame without a message to continue")
                if len(fragments) + len(payload) > self.max_frame:
                    raise ProtocolError(
                        "fragmented message exceeds the " + str(self.max_frame) + "-byte limit",
                        CLOSE_TOO_BIG,
                    )
                fragments += payload
                if not fin:
                    continue
                opcode, payload, fragments = first_opcode, bytes(fragments), None
            elif fragments is not None:
                raise ProtocolError("new message started inside a fragmented one")
            elif not fin:
                fragments, first_opcode = bytearray(payload), opcode
                continue
            return _decode(opcode, payload)

    async def _read_frame(self):
        reader = self._stream()
        head = await reader.readexactly(2)
        size = header_size(head[1])
        if size > 2:
            head += await reader.readexactly(size - 2)
        fin, opcode, length, mask_key = parse_header(head)
        if mask_key is not None:
            raise ProtocolError("the server sent a masked frame")
        if length > self.max_frame:
            raise ProtocolError(
                "incoming frame of "
                + str(length)
                + " bytes exceeds the "
                + str(self.max_frame)
                + "-byte limit",
                CLOSE_TOO_BIG,
            )
        payload = await reader.readexactly(length) if length else b""
        return fin, opcode, payload

    async def _handle_control(self, opcode, payload) -> bool:
        """Answer a ping; True when the frame closed the link."""
        if opcode == OP_PING:
            if self._state == _OPEN:
                await self._write_frame(OP_PONG, payload)
            return False
        if opcode == OP_PONG:
            return False
        self.close_code = close_code_of(payload)
        if self._state == _OPEN:  # the server started the closing handshake: echo its code
            self._state = _CLOSING
            try:
                await self._write_frame(OP_CLOSE, payload[:2])
            except OSError:
                pass
        await self._abort()
        return True

    async def close(self, code=CLOSE_NORMAL):
        """Send a close frame, wait (up to 2 s) for the server to end TCP, then drop it."""
        if self._state == _CLOSED:
            return
        if self._state == _CONNECTING:  # the handshake task still reads: just cut it off
            await self._abort()
            return
        if self._state == _OPEN:
            self._state = _CLOSING
            try:
                await self._write_frame(OP_CLOSE, struct.pack(">H", code))
            except OSError:
                await self._abort()
                return
        try:
            await asyncio.wait_for(self._await_peer_close(), _CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError, EOFError):
            pass
        await self._abort()

    async def _await_peer_close(self):
        if self._reading:  # another task reads; it sees the end of the link and sets the event
            if self._closed_event is None:
                self._closed_event = asyncio.Event()
            await self._closed_event.wait()
            return
        # Read and drop everything until the server closes TCP: closing a socket with unread
        # data sends a TCP reset, which can destroy our close frame before the server reads it.
        reader = self._stream()
        self._reading = True
        try:
            while await reader.read(4096):
                pass
        finally:
            self._reading = False

    def _stream(self):
        reader = self._reader
        if reader is None:
            raise OSError("WebSocket is not connected")
        return reader

    async def _abort(self):
        self._state = _CLOSED
        if self._closed_event is not None:
            self._closed_event.set()
        writer = self._writer
        if writer is None:
            return
        self._writer = None
        try:
            writer.close()
            await writer.wait_closed()  # MicroPython closes the socket only here
        except Exception:  # the socket may already be gone; nothing left to clean up
            pass


def _decode(opcode, payload):
    if opcode == OP_BINARY:
        return payload
    try:
        return str(payload, "utf-8")
    except UnicodeError:
        raise ProtocolError("text frame is not valid UTF-8", CLOSE_INVALID_DATA)
