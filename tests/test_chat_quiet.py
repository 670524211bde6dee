"""Quiet by default (issue #31): a model service or a web search that does not answer is said once
in the log (a warning when it starts failing, one when it answers again, debug in between), in
each turn's metadata (`offline_reason`, `search_error`), and never in the answer's text; the
libraries' own lines about it (ddgs, httpx) are debug detail. Everything runs on loopback: the
model service and the search engines are closed ports there."""

import logging
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog
from rich.console import Console

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatEvent,
    ChatService,
    Done,
    SqliteMemoryStore,
    Token,
    TurnRequest,
    collect,
)
from backend.chat.llm import LlmProvider, OllamaProvider, OpenAiProvider, Usage
from backend.chat.search import DdgsSearch, FallbackSearch, SearxngSearch
from backend.cli.runs import _offline_without_network
from backend.config import Settings
from backend.server import Bridge
from backend.storage import Database
from testkit.llm_server import FakeLlm, Reply
from tests.helpers import run_cli

MODELS = Usage(chat="chat-model", guardrail="guard-model")
QUESTIONS = (
    "How long should I brush my teeth?",
    "How often should I floss?",
    "Is teeth whitening safe?",
)
NOISE = ("unreachable", "ConnectError", "DNSError", "Traceback", "Error in engine")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def memory(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    database = Database(tmp_path / "bridge.sqlite3", CHAT_MIGRATIONS)
    await database.open()
    yield SqliteMemoryStore(database)
    await database.close()


@pytest.fixture
def closed_ddg() -> Iterator[str]:
    """A ddgs engine whose site is a closed loopback port (the real engine, no internet)."""
    from ddgs.engines import ENGINES
    from ddgs.engines.duckduckgo import Duckduckgo

    class ClosedDdg(Duckduckgo):
        name = "closedddg"
        provider = "closed"
        disabled = False
        search_url = f"http://127.0.0.1:{closed_port()}/html/"

    ENGINES["text"]["closedddg"] = ClosedDdg
    yield "closedddg"
    del ENGINES["text"]["closedddg"]


@pytest.fixture
def fake() -> Iterator[FakeLlm]:
    server = FakeLlm().start()
    yield server
    server.stop()


def done(events: list[ChatEvent]) -> Done:
    last = events[-1]
    assert isinstance(last, Done), events
    return last


def text_of(events: list[ChatEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


def warnings_of(logs: list[dict], event: str) -> list[dict]:
    return [line for line in logs if line["event"] == event and line["log_level"] == "warning"]


async def test_a_dead_model_and_search_are_logged_once_and_never_in_the_answer(
    memory: SqliteMemoryStore, closed_ddg: str, caplog: pytest.LogCaptureFixture
) -> None:
    model_port, searx_port = closed_port(), closed_port()
    model_url = f"http://127.0.0.1:{model_port}"
    llm = OllamaProvider(model_url, MODELS, timeout_s=2)
    web = FallbackSearch(
        [
            DdgsSearch(timeout_s=2, backend=closed_ddg),
            SearxngSearch(f"http://127.0.0.1:{searx_port}", timeout_s=2),
        ]
    )
    service = ChatService(memory, llm, web)
    caplog.set_level(logging.INFO)  # what `serve` shows
    turns: list[list[ChatEvent]] = []
    with structlog.testing.capture_logs() as logs:
        for question in QUESTIONS:
            turns.append(await collect(service.run_turn(TurnRequest(text=question))))
    await llm.aclose()

    for events in turns:
        meta = done(events).metadata
        for text in (text_of(events), meta.answer):
            assert text.strip()
            assert not any(word in text for word in NOISE), text
            assert f"127.0.0.1:{model_port}" not in text and f":{searx_port}" not in text
        assert meta.offline and meta.offline_reason == f"ollama unreachable at {model_url}"
        assert meta.search == "failed" and meta.search_error
        assert "duckduckgo: unreachable (connection failed)" in meta.search_error
        assert "searxng: ConnectError" in meta.search_error
        assert meta.sources and all(source.origin == "kb" for source in meta.sources)

    (model,) = warnings_of(logs, "chat model failed")
    assert model["reason"] == f"ollama unreachable at {model_url}"
    assert model["provider"] == "ollama" and "ConnectError" in model["detail"]
    searches = warnings_of(logs, "search provider failed")
    assert sorted(line["provider"] for line in searches) == ["duckduckgo", "searxng"]
    assert all(
        line["log_level"] == "debug" for line in logs if line["event"] == "chat offline mode"
    )
    # Only these three warnings over three turns; the turns after the first say it at debug.
    assert len([line for line in logs if line["log_level"] == "warning"]) == 3
    repeats = [line for line in logs if line["event"] == "chat model failed"][1:]
    assert repeats and all(line["log_level"] == "debug" for line in repeats)
    # The turns' own lines keep the reason (per-turn metadata), at info.
    offline_steps = [line for line in logs if line.get("step") == "offline"]
    assert [line["reason"] for line in offline_steps] == [meta.offline_reason] * 3
    # ddgs logs every failed engine at INFO on its own: debug detail, not shown at info.
    assert not [record for record in caplog.records if record.name.startswith(("ddgs", "httpx"))]


@pytest.mark.parametrize("kind", ["openai", "ollama"])
async def test_a_failing_model_is_logged_when_it_fails_and_when_it_is_back(
    kind: str, fake: FakeLlm, memory: SqliteMemoryStore
) -> None:
    cls = OpenAiProvider if kind == "openai" else OllamaProvider
    llm: LlmProvider = cls(fake.url, MODELS, timeout_s=5)
    fake.script("chat", Reply(status=503), Reply(status=503), Reply("Brush twice a day."))
    service = ChatService(memory, llm)
    with structlog.testing.capture_logs() as logs:
        turns = [await collect(service.run_turn(TurnRequest(text=q))) for q in QUESTIONS]
    await llm.aclose()
    assert [done(events).metadata.offline for events in turns] == [True, True, False]
    assert text_of(turns[2]) == "Brush twice a day."
    model = [line for line in logs if line["event"].startswith("chat model")]
    assert [(line["event"], line["log_level"]) for line in model] == [
        ("chat model failed", "warning"),
        ("chat model failed", "debug"),
        ("chat model answers again", "warning"),
    ]
    assert model[1]["failures"] == 2 and model[2]["failures"] == 2
    assert "HTTP 503" in model[0]["reason"] and "HTTP 503" in turns[0][-1].metadata.offline_reason


async def test_a_refused_api_key_is_said_clearly_once(
    fake: FakeLlm, memory: SqliteMemoryStore
) -> None:
    llm = OpenAiProvider(fake.url, MODELS, api_key="sk-wrong", timeout_s=5)
    fake.script("chat", *[Reply(status=401)] * 3)
    service = ChatService(memory, llm)
    with structlog.testing.capture_logs() as logs:
        turns = [await collect(service.run_turn(TurnRequest(text=q))) for q in QUESTIONS]
    await llm.aclose()
    for events in turns:
        meta = done(events).metadata
        assert meta.offline and "HTTP 401; check llm_api_key" in (meta.offline_reason or "")
        assert "401" not in text_of(events) and "sk-wrong" not in repr(events)
    (warning,) = warnings_of(logs, "chat model failed")
    assert "refused the API key (HTTP 401; check llm_api_key)" in warning["reason"]
    assert "sk-wrong" not in repr(logs)


async def test_the_demo_says_once_what_it_cannot_reach_and_goes_without(tmp_path: Path) -> None:
    settings = Settings.on_loopback(
        tmp_path,
        llm_base_url=f"http://127.0.0.1:{closed_port()}",
        search_providers=["searxng"],
        search_searxng_url=f"http://127.0.0.1:{closed_port()}",
    )
    console = Console(record=True, width=200)
    quiet = await _offline_without_network(settings, console)
    assert quiet.llm_provider == "none" and not quiet.search_enabled
    lines = console.export_text().splitlines()
    assert lines == [
        f"chat: no model service at {settings.llm_base_url}: offline mode (rules for device "
        "commands, quotes from the bundled knowledge base)",
        "chat: no web search reachable (searxng): sources come from the bundled knowledge base",
    ]


@pytest.fixture
async def down_bridge(tmp_path: Path) -> AsyncIterator[tuple[Bridge, str]]:
    """A bridge whose model service and web search are closed loopback ports."""
    model_url = f"http://127.0.0.1:{closed_port()}"
    settings = Settings.on_loopback(
        tmp_path / "data",
        llm_provider="ollama",
        llm_base_url=model_url,
        search_providers=["searxng"],
        search_searxng_url=f"http://127.0.0.1:{closed_port()}",
        search_timeout_s=2,
    )
    async with Bridge(settings) as bridge:
        yield bridge, model_url


async def test_cli_chat_answers_without_transport_noise(down_bridge: tuple[Bridge, str]) -> None:
    bridge, model_url = down_bridge
    data_dir = str(bridge.settings.data_dir)
    stdin = "".join(f"{question}\n" for question in QUESTIONS)
    with structlog.testing.capture_logs() as logs:
        code, out, err = await run_cli("chat", "--data-dir", data_dir, stdin=stdin)
    assert code == 0, err
    assert out.count("Offline mode") == 3 and out.count("Sources:") == 3
    assert not any(word in out for word in NOISE) and "127.0.0.1" not in out
    # Why it is offline: one short line, on stderr, not one per answer.
    assert err.splitlines() == [f"(offline mode: ollama unreachable at {model_url})"]
    assert len(warnings_of(logs, "chat model failed")) == 1
    assert len(warnings_of(logs, "search provider failed")) == 1

    code, out, err = await run_cli("chat", "-v", "--data-dir", data_dir, stdin=stdin)
    assert code == 0 and not any(word in out for word in NOISE)
    lines = err.splitlines()
    assert lines[::2] == [f"(offline mode: ollama unreachable at {model_url})"] * 3
    assert all(line.startswith("(web search failed: searxng: ConnectError") for line in lines[1::2])
