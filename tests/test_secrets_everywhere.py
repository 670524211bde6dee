"""No configured secret is ever shown or logged (issue #32, item 5).

The redaction rule of URLs (`backend.logs.redact_url`, docs/mcp-servers.md "Secrets in URLs")
unit by unit, the filter on library loggers, then a real bridge configured with a secret in every
place one can be configured (an MCP server URL with a path secret and `?api_key=`, its bearer
token, the LLM key, the Google search key, an MQTT broker URL with a password and the MQTT
secret, the vision/ASR/TTS keys, the device secret, the admin and device tokens, API keys from
the key store), a real MCP server over Streamable HTTP on loopback behind that URL, and every
log line captured (the production renderer at DEBUG, a structlog capture in its chain, and the
stdlib root at DEBUG through pytest's handler). The bridge is exercised (servers listed with an
admin key and a `devices:read` key, a tool called in a chat turn, a searched chat turn, a server
that answers 401, `/metrics`, the console pages, `esp32-bridge mcp servers`), then every response
body, header and log line is searched for every secret.
"""

import asyncio
import contextlib
import io
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import structlog
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import LogCapture

from backend.logs import (
    UrlRedactingFilter,
    configure_logging,
    looks_random,
    redact_library_urls,
    redact_url,
    redact_urls,
)
from backend.mcp_servers.hub import ServerState
from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.fakes.mcp_server import build_server
from tests.fakes.search_apis import Answer, FakeSearchApi, google_items, google_page
from tests.helpers import create_key, run_cli, sse_events
from tests.mcp_servers_helpers import server_of, wait_ready, wait_until

# ---- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # the URL: a path secret after `s`, a query secret
        (
            "https://mcp.example/s/Zq8xK2pLmN4vB7wR/mcp?api_key=k3y",
            "https://mcp.example/s/***/mcp?api_key=***",
        ),
        # a plain URL is left alone
        ("https://calendar.example/mcp", "https://calendar.example/mcp"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        # userinfo, the user part too (`https://<token>@host`)
        ("https://user:pw@host.example/mcp", "https://***@host.example/mcp"),
        ("https://ghp_token@host.example/", "https://***@host.example/"),
        ("mqtt://bridge:p%40ss@broker:1883", "mqtt://***@broker:1883"),
        # every query value, names kept; a bare item; a fragment
        ("http://h/x?tz=UTC&token=t&sig=s", "http://h/x?tz=***&token=***&sig=***"),
        ("http://h/x?RAWTOKEN", "http://h/x?***"),
        ("http://h/x?a=1#access_token=t", "http://h/x?a=***#***"),
        ("http://h/x?", "http://h/x?"),
        # path segments after a word that announces a secret, even short or plain ones
        ("http://h/token/abc/mcp", "http://h/token/***/mcp"),
        ("http://h/api/key/hunter2", "http://h/api/key/***"),
        ("http://h/s/secret/mcp", "http://h/s/***/mcp"),
        ("http://h/api_key=abc/mcp", "http://h/api_key=***/mcp"),
        # random-looking segments, 16+ characters
        (
            "http://h/hooks/T0AB12CD3/B0XY98ZQ7/a1B2c3D4e5F6g7H8",
            "http://h/hooks/T0AB12CD3/B0XY98ZQ7/***",
        ),
        ("http://h/550e8400-e29b-41d4-a716-446655440000/mcp", "http://h/***/mcp"),
        ("http://h/0123456789abcdef0123/mcp", "http://h/***/mcp"),
        ("http://h/abcdefghijklmnopqrstuvwxyzabcdefgh", "http://h/***"),
        ("http://h/%5A%71%38%78K2pLmN4vB7wR/mcp", "http://h/***/mcp"),
        # names are kept, however long
        ("http://h/mcp-server-endpoint-v2/mcp", "http://h/mcp-server-endpoint-v2/mcp"),
        ("http://h/2024-11-05-release-notes", "http://h/2024-11-05-release-notes"),
        ("http://h/streamable_http_endpoint", "http://h/streamable_http_endpoint"),
        # IPv6 hosts and ports are kept as they are
        ("http://[::1]:8443/s/abc?key=v", "http://[::1]:8443/s/***?key=***"),
        ("https://u:p@[fe80::1%25eth0]:9/", "https://***@[fe80::1%25eth0]:9/"),
        ("http://example.com:65535/", "http://example.com:65535/"),
        # malformed: redacted as far as it splits, never an exception
        ("http://[::1/s/abc?key=v", "http://[::1/s/***?key=***"),
        ("http://h:notaport/x?key=v", "http://h:notaport/x?key=***"),
        ("http://u:p@", "http://***@"),
        ("http:///path?k=v", "http:///path?k=***"),
        ("/s/abc/mcp?api_key=v", "/s/***/mcp?api_key=***"),
        ("user:pw@host/x", "***@host/x"),
        ("", ""),
        ("not a url", "not a url"),
    ],
)
def test_the_redaction_rule(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # idempotent


def test_a_segment_looks_random_only_when_long_and_mixed() -> None:
    assert looks_random("Zq8xK2pLmN4vB7wR")
    assert not looks_random("Zq8xK2pLmN4vB7w")  # 15 characters
    assert not looks_random("abcdefghijklmnop")  # one kind of character: a word
    assert not looks_random("Zq8xK2pLmN4vB7wR.json")  # a dot: a file name
    assert looks_random("x" * 32)


@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_redaction_never_raises_and_is_idempotent(text: str) -> None:
    for candidate in (text, "http://" + text, "https://u:p@" + text, "/" + text):
        once = redact_url(candidate)
        assert isinstance(once, str) and redact_url(once) == once
        assert isinstance(redact_urls(candidate), str)


def test_urls_inside_text_are_redacted() -> None:
    line = (
        "HTTP Request: POST http://127.0.0.1:9/s/Zq8xK2pLmN4vB7wR/mcp?api_key=k3y "
        '"HTTP/1.1 401 Unauthorized"'
    )
    assert redact_urls(line) == (
        'HTTP Request: POST http://127.0.0.1:9/s/***/mcp?api_key=*** "HTTP/1.1 401 Unauthorized"'
    )
    error = "Client error '401 Unauthorized' for url 'https://h/x?api_key=k3y'"
    assert redact_urls(error) == "Client error '401 Unauthorized' for url 'https://h/x?api_key=***'"
    uvicorn_line = '127.0.0.1:5 - "WebSocket /v1/mcp-endpoint/?token=esk_abc" [accepted]'
    assert redact_urls(uvicorn_line) == (
        '127.0.0.1:5 - "WebSocket /v1/mcp-endpoint/?token=***" [accepted]'
    )
    assert redact_urls("how often should I floss? twice a day") == (
        "how often should I floss? twice a day"
    )


def test_the_library_filter_redacts_message_arguments_and_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    redact_library_urls()
    logger = logging.getLogger("httpx2")
    assert any(isinstance(f, UrlRedactingFilter) for f in logger.filters)
    url = httpx.URL("http://127.0.0.1:9/s/Zq8xK2pLmN4vB7wR/mcp?api_key=k3y")  # not a str
    with caplog.at_level(logging.DEBUG):
        logger.info('HTTP Request: %s %s "%s %d %s"', "POST", url, "HTTP/1.1", 200, "OK")
        try:
            raise RuntimeError(f"failed for url '{url}'")
        except RuntimeError:
            logging.getLogger("mcp.client.streamable_http").debug("GET stream error", exc_info=True)
        logging.getLogger("client").warning("bad %s", "ws://u:pw@h/x")
    text = "\n".join(caplog.text.splitlines())
    assert "k3y" not in text and "Zq8xK2pLmN4vB7wR" not in text and "pw@" not in text
    assert "/s/***/mcp?api_key=***" in text and "RuntimeError" in text
    assert caplog.records[0].getMessage() == (
        'HTTP Request: POST http://127.0.0.1:9/s/***/mcp?api_key=*** "HTTP/1.1 200 OK"'
    )


# ---- a whole bridge ---------------------------------------------------------------------------

PATH_SECRET = "Pq7ZrX2mKw9LvT4nB8sY"
QUERY_SECRET = "qK4wS3cr3tV4lu3x"
WRONG_PATH_SECRET = "Wn6GhT2pQx8ZrL3kF5dM"
WRONG_QUERY_SECRET = "wR0ngQu3ryS3cr3t"
BEARER = "mcpBearerS3cret5511"
LLM_KEY = "sk-llmS3cretKey7731"
GOOGLE_KEY = "AIzaGoogleS3cret9902"
MQTT_PASSWORD = "mqttBrokerPassw0rd4417"
MQTT_SECRET = "mqtt-derivation-secret-88412390"
DEVICE_SECRET = "device-derivation-secret-1299"
VISION_KEY = "visionS3cretKey6623"
ASR_KEY = "asrS3cretKey3381"
TTS_KEY = "ttsS3cretKey7754"
CONFIGURED = [
    PATH_SECRET,
    QUERY_SECRET,
    WRONG_PATH_SECRET,
    WRONG_QUERY_SECRET,
    BEARER,
    LLM_KEY,
    GOOGLE_KEY,
    MQTT_PASSWORD,
    MQTT_SECRET,
    DEVICE_SECRET,
    VISION_KEY,
    ASR_KEY,
    TTS_KEY,
    ADMIN_TOKEN,
    DEVICE_TOKEN,
]


class _SecretUrl:
    """Pure ASGI in front of the fake MCP server: only `/s/<PATH_SECRET>/mcp?api_key=<QUERY_SECRET>`
    with the bearer token reaches it (as `/mcp`); anything else is 401."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.served = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode())
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        if (
            scope["path"] != f"/s/{PATH_SECRET}/mcp"
            or query.get("api_key") != [QUERY_SECRET]
            or authorization != f"Bearer {BEARER}".encode()
        ):
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"unauthorized"})
            return
        self.served += 1
        scope = {**scope, "path": "/mcp", "raw_path": b"/mcp", "query_string": b""}
        await self.app(scope, receive, send)


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def secret_mcp_server() -> AsyncIterator[str]:
    """The fake MCP server behind `_SecretUrl` on loopback; yields its base URL."""
    app = _SecretUrl(build_server("web").streamable_http_app())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = _Quiet(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        sock.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Captured:
    """Every line the bridge logs: the production renderer's output (JSON, DEBUG), a structlog
    capture at the end of its processor chain, and pytest's stdlib handler on the root."""

    def __init__(self, stream: io.StringIO, capture: LogCapture, caplog: Any) -> None:
        self.stream = stream
        self.capture = capture
        self.caplog = caplog

    def texts(self) -> Iterator[tuple[str, str]]:
        yield "rendered log", self.stream.getvalue()
        for entry in self.capture.entries:
            yield "structlog event", repr(entry)
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        for record in self.caplog.records:
            yield f"stdlib record {record.name}", formatter.format(record)


@pytest.fixture
def captured(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Iterator[Captured]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("debug", "json")  # the production chain, rendering into `stream`
    capture = LogCapture()
    processors = list(structlog.get_config()["processors"])
    processors.insert(len(processors) - 1, capture)  # before wrap_for_formatter
    structlog.configure(processors=processors, cache_logger_on_first_use=False)
    root.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield Captured(stream, capture, caplog)
    finally:
        structlog.reset_defaults()
        root.handlers[:] = handlers
        root.setLevel(level)


def leaks(texts: Iterator[tuple[str, str]], secrets: list[str]) -> list[str]:
    found = []
    for where, text in texts:
        for secret in secrets:
            if secret in text:
                start = text.index(secret)
                found.append(f"{secret!r} in {where}: …{text[max(0, start - 120) : start + 60]}…")
    return found


async def test_no_secret_is_shown_or_logged(
    bridge_factory: Any, fake_llm: FakeLlm, captured: Captured, tmp_path: Path
) -> None:
    search = FakeSearchApi(Answer(document=google_page(google_items(3))))
    seen: list[tuple[str, str]] = []  # (where, text) of every response, header and output

    def keep(where: str, response: httpx.Response) -> httpx.Response:
        seen.append((f"{where} body", response.text))
        seen.append((f"{where} headers", repr(list(response.headers.items()))))
        return response

    try:
        async with secret_mcp_server() as base:
            url = f"{base}/s/{PATH_SECRET}/mcp?api_key={QUERY_SECRET}"
            wrong = f"{base}/s/{WRONG_PATH_SECRET}/mcp?api_key={WRONG_QUERY_SECRET}"
            bridge: Bridge = await bridge_factory(
                llm_provider="openai",
                llm_base_url=fake_llm.url,
                llm_api_key=LLM_KEY,
                search_enabled=True,
                search_providers=["google"],
                search_google_api_key=GOOGLE_KEY,
                search_google_engine_id="cx-engine",
                search_google_url=search.google_url,
                mqtt_url=f"mqtt://bridge:{MQTT_PASSWORD}@127.0.0.1:{closed_port()}",
                mqtt_secret=MQTT_SECRET,
                udp_host="127.0.0.1",
                udp_port=0,
                device_secret=DEVICE_SECRET,
                vision_base_url=f"{fake_llm.url}/v1",
                vision_api_key=VISION_KEY,
                asr_api_key=ASR_KEY,
                tts_api_key=TTS_KEY,
                metrics_port=0,
                mcp_servers=[
                    {"name": "web", "url": url, "bearer_token": BEARER},
                    {
                        "name": "bad",
                        "url": wrong,
                        "bearer_token": BEARER,
                        "connect_timeout_s": 5,
                    },
                ],
            )
            await wait_ready(bridge, "web")
            bad = server_of(bridge, "bad")
            await wait_until(lambda: bad.state is ServerState.BACKING_OFF)
            reader = await create_key(bridge, "devices:read")
            chatter = await create_key(bridge, "chat:use", "mcp:web")
            scraper = await create_key(bridge, "metrics:read")
            keys = [reader, chatter, scraper]

            async with httpx.AsyncClient(base_url=bridge.api_url, timeout=60) as http:
                admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                for who, token in (("admin", ADMIN_TOKEN), ("devices:read", reader)):
                    listed = keep(
                        f"servers as {who}",
                        await http.get(
                            "/api/mcp/servers", headers={"Authorization": f"Bearer {token}"}
                        ),
                    )
                    assert listed.status_code == 200, listed.text
                    by_name = {item["name"]: item for item in listed.json()["servers"]}
                    assert by_name["web"]["target"] == f"{base}/s/***/mcp?api_key=***"
                    assert by_name["bad"]["target"] == f"{base}/s/***/mcp?api_key=***"
                    # Failed once and retrying: between attempts or in the next one (its
                    # backoff is about 0.5 s, shorter than this listing takes on a loaded machine).
                    assert by_name["bad"]["state"] in ("backing-off", "connecting")
                    assert by_name["bad"]["last_error"]

                # a tool of the server in a chat turn, with a key that may use it
                fake_llm.script(
                    "chat",
                    Reply(calls=[FakeCall("web__echo", {"text": "hi"})]),
                    Reply("It said hi."),
                )
                async with http.stream(
                    "POST",
                    "/api/chat/stream",
                    json={"message": "Echo hi please"},
                    headers={"Authorization": f"Bearer {chatter}"},
                ) as response:
                    assert response.status_code == 200
                    events = await sse_events(response)
                seen.append(("chat stream", json.dumps(events)))
                results = [e for e in events if e.get("type") == "mcp_tool"]
                assert results and results[-1]["status"] == "completed", events

                # a searched turn (the Google key goes in the query of every search request)
                keep(
                    "chat completion",
                    await http.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "how often to floss"}]},
                        headers=admin,
                    ),
                )
                keep("metrics", await http.get("/metrics", headers=admin))
                if bridge.metrics_listener is not None:
                    keep(
                        "metrics listener",
                        await http.get(
                            f"{bridge.metrics_listener.url}/metrics",
                            headers={"Authorization": f"Bearer {scraper}"},
                        ),
                    )
                for page in ("/", "/settings", "/devices", "/talk", "/console/common.js"):
                    keep(f"console {page}", await http.get(page))
                keep("healthz", await http.get("/healthz"))
                keep("keys", await http.get("/api/keys", headers=admin))

            code, out, err = await run_cli(
                "mcp", "servers", "--json", "--server", bridge.api_url, "--token", reader
            )
            assert code == 0, err
            seen += [("cli json", out), ("cli stderr", err)]
            code, out, err = await run_cli(
                "mcp", "servers", "--server", bridge.api_url, "--token", reader
            )
            assert code == 0, err
            seen += [("cli table", out), ("cli stderr", err)]
            assert "mcp?api_key" not in out  # the table shows no target at all

            assert search.seen and search.seen[0].query["key"] == [GOOGLE_KEY]  # it was sent
            await bridge.stop()
    finally:
        search.close()

    everything = [*seen, *captured.texts()]
    assert leaks(iter(everything), [*CONFIGURED, *keys]) == []
    # The capture works: the lines that carried the secrets are there, redacted.
    rendered = captured.stream.getvalue()
    assert "/s/***/mcp?api_key=***" in rendered
    assert "customsearch/v1?" in rendered and "key=***" in rendered  # httpx's request line
    assert "HTTP Request" in rendered
    assert any(r.name.startswith(("httpx", "mcp")) for r in captured.caplog.records)
