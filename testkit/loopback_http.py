"""A threaded HTTP server on 127.0.0.1 with an ephemeral port, in a daemon thread: the base of
the fake services that tests and benchmarks talk to (the LLM, speech and transcription
servers), so each fake is only its handler and its script."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self


class LoopbackHttpServer:
    """Every instance of `handler` gets the fake that serves it as `self.owner`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.handler = handler
        self.url = ""
        self.stopping = threading.Event()  # set by stop(): wakes replies that wait
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> Self:
        handler: Any = type("Handler", (self.handler,), {"owner": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Close the port (later requests get `connection refused`)."""
        self.stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
