"""The stock firmware's photo upload, read as it streams (sans-I/O: fed chunk by chunk).

The body is `multipart/form-data` (boundary `----ESP32_CAMERA_BOUNDARY`, chunked) with a
`question` text field and a `file` part (`camera.jpg`, `image/jpeg`); protocol reference §4.5.
`UploadReader.feed` refuses a body past its cap at the chunk that crosses it, so at most the cap
is ever held; other parts are skipped, their bytes counted.
"""

from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

MAX_QUESTION_BYTES = 4096
MAX_PARTS = 8

# Magic bytes of the image formats vision models take, and the MIME type each is sent as.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


class UploadError(Exception):
    """The body is not a usable upload; `status` is the HTTP answer (400, 413, 415)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Upload:
    """A photo upload as read: the question, the image and its checked media type."""

    question: str
    image: bytes
    media_type: str  # from the magic bytes, not from what the device declared
    body_bytes: int


def image_type(data: bytes) -> str | None:
    """The image's MIME type by its magic bytes (JPEG, PNG, GIF, WebP, BMP), else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, media_type in _MAGIC:
        if data.startswith(magic):
            return media_type
    return None


def boundary_of(content_type: str | None) -> bytes:
    """The multipart boundary of a Content-Type; raises UploadError (400) if it is not multipart."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary", b"")
    if kind != b"multipart/form-data" or not boundary or len(boundary) > 200:
        raise UploadError(400, "expected a multipart/form-data body with a boundary")
    return boundary


class UploadReader:
    """Feed the body's chunks, then `finish()` for the `Upload`."""

    def __init__(self, content_type: str | None, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self.size = 0
        self._parts = 0
        self._name: str | None = None
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._current = bytearray()
        self._question: bytes | None = None
        self._image: bytes | None = None
        self._ended = False
        self._parser = MultipartParser(
            boundary_of(content_type),
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field_data,
                "on_header_value": self._header_value_data,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_end": self._end,
            },
        )

    def feed(self, chunk: bytes) -> None:
        """Parse one chunk of the body; raises UploadError (413 past the size limit, 400 when
        malformed)."""
        self.size += len(chunk)
        if self.size > self._max_bytes:
            raise UploadError(413, f"the upload is larger than {self._max_bytes} bytes")
        try:
            self._parser.write(chunk)
        except MultipartParseError as exc:
            raise UploadError(400, f"malformed multipart body: {exc}") from None

    def finish(self) -> Upload:
        """The upload once the body ended; raises UploadError when it is malformed or incomplete."""
        try:
            self._parser.finalize()
        except MultipartParseError as exc:
            raise UploadError(400, f"malformed multipart body: {exc}") from None
        if not self._ended:
            raise UploadError(400, "the multipart body ends before its closing boundary")
        if not self._image:
            raise UploadError(400, "no 'file' part with the photo")
        media_type = image_type(self._image)
        if media_type is None:
            raise UploadError(415, "the 'file' part is not a JPEG, PNG, GIF, WebP or BMP image")
        question = (self._question or b"").decode("utf-8", "replace").strip()
        return Upload(question, self._image, media_type, self.size)

    # ---- parser callbacks ----------------------------------------------------------------------

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise UploadError(400, f"more than {MAX_PARTS} parts")
        self._name, self._disposition = None, b""
        self._current.clear()

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if bytes(self._header_field).strip().lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _kind, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "question" and len(self._current) + end - start > MAX_QUESTION_BYTES:
            raise UploadError(413, f"the question is longer than {MAX_QUESTION_BYTES} bytes")
        if self._name in ("question", "file"):
            self._current += data[start:end]  # bounded by the body's cap

    def _part_end(self) -> None:
        if self._name == "question" and self._question is None:
            self._question = bytes(self._current)
        elif self._name == "file" and self._image is None:
            self._image = bytes(self._current)
        self._current.clear()

    def _end(self) -> None:
        self._ended = True
