"""Loopback stand-ins for the search APIs the bridge calls over HTTP: Google's Custom Search JSON
API (`GET /customsearch/v1?key=…&cx=…&q=…&num=…`) and a SearxNG instance
(`GET /search?q=…&format=json`), answering in their real JSON shapes, or with an error status,
a broken body, an oversize body or no answer at all."""

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


def google_items(count: int, prefix: str = "g") -> list[dict[str, Any]]:
    """Items as the Custom Search API lists them (kind, title, link, snippet, displayLink...)."""
    return [
        {
            "kind": "customsearch#result",
            "title": f"Google result {i}",
            "htmlTitle": f"<b>Google</b> result {i}",
            "link": f"https://{prefix}.example/{i}",
            "displayLink": f"{prefix}.example",
            "snippet": f"Snippet {i} about brushing twice a day.",
            "formattedUrl": f"https://{prefix}.example/{i}",
        }
        for i in range(count)
    ]


def google_page(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A Custom Search answer; no `items` key at all when nothing was found (as Google does)."""
    page: dict[str, Any] = {
        "kind": "customsearch#search",
        "queries": {"request": [{"totalResults": str(len(items or []))}]},
        "searchInformation": {"searchTime": 0.2, "totalResults": str(len(items or []))},
    }
    if items:
        page["items"] = items
    return page


def google_error(code: int, message: str, status: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "errors": [], "status": status}}


def searxng_results(count: int, prefix: str = "s") -> list[dict[str, Any]]:
    return [
        {
            "url": f"https://{prefix}.example/{i}",
            "title": f"SearxNG result {i}",
            "content": f"Content {i}: floss once a day.",
            "engine": "duckduckgo",
            "engines": ["duckduckgo", "brave"],
            "score": 2.0 - i / 10,
            "category": "general",
            "parsed_url": ["https", f"{prefix}.example", f"/{i}", "", "", ""],
        }
        for i in range(count)
    ]


def searxng_page(query: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "query": query,
        "number_of_results": 0,
        "results": results,
        "answers": [],
        "corrections": [],
        "infoboxes": [],
        "suggestions": [],
        "unresponsive_engines": [],
    }


@dataclass
class Answer:
    """What the fake answers next: a status and a JSON document, or raw bytes (with extra
    `headers`); `hang` answers nothing until the server stops; `length` overrides
    Content-Length (None: the real one, -1: none, the body then ends with the connection)."""

    status: int = 200
    document: Any = None
    raw: bytes | None = None
    hang: bool = False
    drip: bool = False  # headers, then one byte every 50 ms until the server stops
    length: int | None = None
    content_type: str = "application/json; charset=UTF-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str] = field(default_factory=dict)


class FakeSearchApi:
    """One HTTP server on 127.0.0.1; `answer` is what every request gets (a callable of the
    request may build it, e.g. to echo the query). Requests are recorded in `seen`."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.answer: Answer | Any = answer or Answer(document={})
        self.seen: list[Seen] = []
        self.stopping = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                seen = Seen(parts.path, parse_qs(parts.query), dict(self.headers.items()))
                owner.seen.append(seen)
                answer = owner.answer(seen) if callable(owner.answer) else owner.answer
                if answer.hang:
                    owner.stopping.wait()
                    return
                body = (
                    answer.raw if answer.raw is not None else json.dumps(answer.document).encode()
                )
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                if answer.drip:
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    while not owner.stopping.wait(0.05):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                    return
                if answer.length != -1:
                    length = len(body) if answer.length is None else answer.length
                    self.send_header("Content-Length", str(length))
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def google_url(self) -> str:
        return f"{self.base}/customsearch/v1"

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
