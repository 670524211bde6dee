"""Web search providers over real HTTP on loopback: Google Programmable Search (Custom Search JSON
API) and SearxNG answering in their real JSON shapes and failing the ways they do (403, 429, 500,
broken JSON, oversize, no answer), the fallback order, the settings that choose them, the
knowledge base's minimum score, and each result's origin carried to a turn's Sources."""

import gzip
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from backend.chat import (
    CHAT_MIGRATIONS,
    ChatService,
    DdgsSearch,
    Done,
    FallbackSearch,
    GoogleSearch,
    KnowledgeBase,
    SearchFailed,
    SearchResult,
    SearxngSearch,
    Sources,
    SqliteMemoryStore,
    TurnRequest,
    collect,
    web_search_from_settings,
)
from backend.chat.knowledge import DEFAULT_KB_MIN_SCORE
from backend.chat.llm import OpenAiProvider, Usage
from backend.chat.search import MAX_CONTENT_CHARS, MAX_TITLE_CHARS
from backend.config import ConfigError, Settings, load_settings
from backend.storage import Database
from testkit.llm_server import FakeLlm, Reply
from tests.fakes.search import FakeWebSearch
from tests.fakes.search_apis import (
    Answer,
    FakeSearchApi,
    google_error,
    google_items,
    google_page,
    searxng_page,
    searxng_results,
)

KEY = "AIzaSy-test-key-0123456789"
CX = "0123456789abcdef0"


@pytest.fixture
def api() -> Iterator[FakeSearchApi]:
    server = FakeSearchApi()
    yield server
    server.close()


@pytest.fixture
def second() -> Iterator[FakeSearchApi]:
    server = FakeSearchApi()
    yield server
    server.close()


def google(api: FakeSearchApi, timeout_s: float = 30.0, **kwargs: int) -> GoogleSearch:
    return GoogleSearch(KEY, CX, url=api.google_url, timeout_s=timeout_s, **kwargs)


async def failure(search: GoogleSearch | SearxngSearch | FallbackSearch) -> str:
    with pytest.raises(SearchFailed) as caught:
        await search.search("how often floss", 5)
    message = str(caught.value)
    assert KEY not in message
    return message


# ---- Google Programmable Search --------------------------------------------------------------


async def test_google_sends_key_cx_query_and_count_and_reads_items(api: FakeSearchApi) -> None:
    api.answer = Answer(document=google_page(google_items(3)))
    results = await google(api).search("how often should I floss", 3)
    assert [(r.title, r.link, r.origin) for r in results] == [
        (f"Google result {i}", f"https://g.example/{i}", "google") for i in range(3)
    ]
    assert results[0].content == "Snippet 0 about brushing twice a day."
    (seen,) = api.seen
    assert seen.path == "/customsearch/v1"
    assert seen.query == {
        "key": [KEY],
        "cx": [CX],
        "q": ["how often should I floss"],
        "num": ["3"],
    }


async def test_google_asks_for_at_most_ten_and_keeps_at_most_n(api: FakeSearchApi) -> None:
    api.answer = Answer(document=google_page(google_items(10)))
    assert len(await google(api).search("floss", 20)) == 10
    assert api.seen[0].query["num"] == ["10"]  # the API answers 400 to num > 10
    assert len(await google(api).search("floss", 2)) == 2


async def test_google_without_items_means_no_results(api: FakeSearchApi) -> None:
    api.answer = Answer(document=google_page(None))
    assert await google(api).search("zxqv plorp", 5) == []


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (400, "API key not valid. Please pass a valid API key.", "INVALID_ARGUMENT"),
        (403, "The caller does not have permission", "PERMISSION_DENIED"),
        (429, "Quota exceeded for quota metric 'Queries' of service", "RESOURCE_EXHAUSTED"),
    ],
)
async def test_google_errors_say_googles_reason_without_the_key(
    api: FakeSearchApi, status: int, error: str, expected: str
) -> None:
    # A hostile or careless server echoes the key back: it must not reach the message.
    api.answer = Answer(status, google_error(status, f"{error} key={KEY}", expected))
    message = await failure(google(api))
    assert message.startswith(f"google: HTTP {status} ({expected} {error}")
    assert "***" in message


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (Answer(500, raw=b"<html>Internal error</html>", content_type="text/html"), "HTTP 500"),
        (Answer(503, raw=b""), "HTTP 503"),
        (Answer(429, raw=b"slow down"), "HTTP 429 (rate limited)"),
        (Answer(200, raw=b'{"items": [ {"link": '), "HTTP 200 but the answer is not JSON"),
        (Answer(200, raw=b"\xff\xfe\x00garbage"), "HTTP 200 but the answer is not JSON"),
        (Answer(200, document=["not", "an", "object"]), "not a Custom Search result object"),
    ],
)
async def test_google_bad_answers_become_search_failed(
    api: FakeSearchApi, answer: Answer, expected: str
) -> None:
    api.answer = answer
    assert expected in await failure(google(api))


async def test_google_that_never_answers_times_out(api: FakeSearchApi) -> None:
    api.answer = Answer(hang=True)
    assert await failure(google(api, timeout_s=0.3)) == "google: no answer within 0.3 s"


async def test_google_unreachable_fails_cleanly(api: FakeSearchApi) -> None:
    api.close()  # connection refused, as with no route to googleapis.com
    assert (await failure(google(api))).startswith("google: ConnectError")


async def test_oversize_answers_are_not_read(api: FakeSearchApi) -> None:
    big = google_page([*google_items(1), {"link": "https://x.example", "snippet": "x" * 5000}])
    api.answer = Answer(document=big)
    assert "bytes (limit 1024)" in await failure(google(api, max_bytes=1024))
    api.answer = Answer(document=big, length=-1)  # no Content-Length: counted while reading
    assert "answer over 1024 bytes" in await failure(google(api, max_bytes=1024))
    assert len(await google(api).search("floss", 5)) == 2  # the default limit reads it


async def test_deeply_nested_json_is_a_failure_not_a_crash(api: FakeSearchApi) -> None:
    api.answer = Answer(raw=b"[" * 200_000 + b"]" * 200_000)  # past the parser's recursion limit
    assert "not JSON" in await failure(google(api))


async def test_compressed_answers_are_not_inflated(api: FakeSearchApi) -> None:
    # A gzip bomb: 50 KB on the wire, 50 MB inflated. The request asked for no compression;
    # the answer is read as it came and fails as JSON instead of filling memory.
    bomb = gzip.compress(b"[" + b" " * 50_000_000 + b"]")
    api.answer = Answer(raw=bomb, headers={"Content-Encoding": "gzip"})
    assert "not JSON" in await failure(google(api))
    assert api.seen[0].headers["Accept-Encoding"] == "identity"


async def test_an_answer_that_trickles_forever_times_out(api: FakeSearchApi) -> None:
    api.answer = Answer(drip=True)  # headers, then a byte now and then, never the end
    assert await failure(google(api, timeout_s=0.5)) == "google: no answer within 0.5 s"


async def test_a_flood_of_items_gives_n_results(api: FakeSearchApi) -> None:
    api.answer = Answer(document=google_page(google_items(20_000)))  # ~4 MB...
    assert "(limit 2097152)" in await failure(google(api))  # ...is over the 2 MiB limit
    api.answer = Answer(document=google_page(google_items(5_000)))
    assert len(await google(api).search("floss", 10)) == 10


async def test_hostile_items_never_become_sources(api: FakeSearchApi) -> None:
    items = [
        {"title": "script", "link": "javascript:alert(1)", "snippet": "x"},
        {"title": "data", "link": "data:text/html,<script>", "snippet": "x"},
        {"title": "relative", "link": "/local/path", "snippet": "x"},
        {"title": "no host", "link": "https://", "snippet": "x"},
        {"title": "not a string", "link": ["https://a.example"], "snippet": "x"},
        {"title": "no link", "snippet": "x"},
        "not an object",
        None,
        {"title": "A" * 5000, "link": "https://ok.example/1", "snippet": "B" * 50_000},
        {"link": "https://ok.example/2", "snippet": None},
        {"title": "again", "link": "https://ok.example/1", "snippet": "duplicate"},
    ]
    api.answer = Answer(document=google_page(items))
    results = await google(api).search("floss", 10)
    assert [r.link for r in results] == ["https://ok.example/1", "https://ok.example/2"]
    assert len(results[0].title) == MAX_TITLE_CHARS and len(results[0].content) == MAX_CONTENT_CHARS
    assert results[1].title == "https://ok.example/2" and results[1].content == ""


async def test_google_items_that_are_not_a_list_are_no_results(api: FakeSearchApi) -> None:
    api.answer = Answer(document={"items": {"link": "https://a.example"}})
    assert await google(api).search("floss", 5) == []


async def test_the_key_never_reaches_the_logs(
    api: FakeSearchApi, caplog: pytest.LogCaptureFixture
) -> None:
    api.answer = Answer(document=google_page(google_items(2)))
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        await FallbackSearch([google(api)]).search("floss", 5)
        api.answer = Answer(403, google_error(403, f"bad key {KEY}", "PERMISSION_DENIED"))
        with pytest.raises(SearchFailed):
            await FallbackSearch([google(api)]).search("floss", 5)
    requests = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert requests and all("key=***" in line for line in requests)  # httpx logs each URL
    assert KEY not in caplog.text and KEY not in repr(logs)
    assert any(line["event"] == "search provider failed" for line in logs)


def test_google_needs_a_key_and_an_engine_id() -> None:
    with pytest.raises(ValueError):
        GoogleSearch("", CX)
    with pytest.raises(ValueError):
        GoogleSearch(KEY, "")


# ---- SearxNG ----------------------------------------------------------------------------------


async def test_searxng_asks_for_json_and_reads_results(api: FakeSearchApi) -> None:
    api.answer = lambda seen: Answer(document=searxng_page(seen.query["q"][0], searxng_results(4)))
    results = await SearxngSearch(f"{api.base}/searx/").search("chảy máu chân răng", 3)
    assert [(r.link, r.origin) for r in results] == [
        (f"https://s.example/{i}", "searxng") for i in range(3)
    ]
    assert results[0].title == "SearxNG result 0" and results[0].content.startswith("Content 0")
    (seen,) = api.seen
    assert seen.path == "/searx/search"
    assert seen.query == {"q": ["chảy máu chân răng"], "format": ["json"]}


async def test_searxng_lists_a_page_once(api: FakeSearchApi) -> None:
    rows = searxng_results(2) + searxng_results(2)  # the same pages from two engines
    api.answer = Answer(document=searxng_page("q", rows))
    assert [r.link for r in await SearxngSearch(api.base).search("floss", 5)] == [
        "https://s.example/0",
        "https://s.example/1",
    ]


async def test_searxng_without_json_output_says_how_to_enable_it(api: FakeSearchApi) -> None:
    api.answer = Answer(403, raw=b"<h1>Forbidden</h1>", content_type="text/html")
    message = await failure(SearxngSearch(api.base))
    assert (
        message == "searxng: HTTP 403 (is the json format enabled in the instance's settings.yml?)"
    )


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (Answer(429, raw=b"Too Many Requests"), "searxng: HTTP 429 (rate limited)"),
        (Answer(500, raw=b"oops"), "searxng: HTTP 500"),
        (Answer(200, raw=b"<html>results</html>"), "searxng: HTTP 200 but the answer is not JSON"),
        (Answer(200, document="results"), "searxng: the answer is not a SearxNG result object"),
    ],
)
async def test_searxng_bad_answers_become_search_failed(
    api: FakeSearchApi, answer: Answer, expected: str
) -> None:
    api.answer = answer
    assert await failure(SearxngSearch(api.base)) == expected


async def test_searxng_that_never_answers_times_out(api: FakeSearchApi) -> None:
    api.answer = Answer(hang=True)
    assert await failure(SearxngSearch(api.base, timeout_s=0.3)) == (
        "searxng: no answer within 0.3 s"
    )


async def test_searxng_behind_basic_auth_keeps_its_password_out_of_logs(
    api: FakeSearchApi, caplog: pytest.LogCaptureFixture
) -> None:
    api.answer = Answer(document=searxng_page("q", searxng_results(1)))
    caplog.set_level(logging.DEBUG)
    url = api.base.replace("http://", "http://bridge:s3cret-pass@")
    assert len(await SearxngSearch(url).search("floss", 5)) == 1
    assert api.seen[0].headers["Authorization"] == "Basic YnJpZGdlOnMzY3JldC1wYXNz"
    api.answer = Answer(500, raw=b"down")
    with pytest.raises(SearchFailed) as caught:
        await SearxngSearch(url).search("floss", 5)
    assert any(r.name == "httpx" for r in caplog.records)
    assert "s3cret-pass" not in caplog.text and "s3cret-pass" not in str(caught.value)


def test_searxng_needs_an_http_url() -> None:
    with pytest.raises(ValueError):
        SearxngSearch("searx.example")


# ---- the fallback order -----------------------------------------------------------------------


async def test_fallback_uses_the_next_provider_when_one_fails(
    api: FakeSearchApi, second: FakeSearchApi
) -> None:
    api.answer = Answer(429, google_error(429, "Quota exceeded", "RESOURCE_EXHAUSTED"))
    second.answer = Answer(document=searxng_page("q", searxng_results(2)))
    search = FallbackSearch([google(api), SearxngSearch(second.base)])
    with structlog.testing.capture_logs() as logs:
        results = await search.search("floss", 5)
    assert {r.origin for r in results} == {"searxng"} and len(results) == 2
    assert len(api.seen) == 1 and len(second.seen) == 1
    failed = next(line for line in logs if line["event"] == "search provider failed")
    assert failed["provider"] == "google" and "HTTP 429" in failed["error"]
    answered = next(line for line in logs if line["event"] == "search answered")
    assert answered["provider"] == "searxng" and answered["results"] == 2


async def test_fallback_stops_at_the_first_provider_with_results(
    api: FakeSearchApi, second: FakeSearchApi
) -> None:
    api.answer = Answer(document=searxng_page("q", searxng_results(2)))
    second.answer = Answer(document=google_page(google_items(2)))
    search = FallbackSearch([SearxngSearch(api.base), google(second)])
    assert search.names == ["searxng", "google"]
    assert {r.origin for r in await search.search("floss", 5)} == {"searxng"}
    assert second.seen == []


async def test_fallback_moves_on_when_a_provider_finds_nothing(
    api: FakeSearchApi, second: FakeSearchApi
) -> None:
    api.answer = Answer(document=searxng_page("q", []))
    second.answer = Answer(document=google_page(google_items(1)))
    results = await FallbackSearch([SearxngSearch(api.base), google(second)]).search("floss", 5)
    assert [r.origin for r in results] == ["google"]


async def test_fallback_with_nothing_found_anywhere_is_no_results_not_a_failure(
    api: FakeSearchApi, second: FakeSearchApi
) -> None:
    api.answer = Answer(500, raw=b"down")
    second.answer = Answer(document=google_page(None))
    assert await FallbackSearch([SearxngSearch(api.base), google(second)]).search("x", 5) == []


async def test_fallback_lists_every_reason_when_all_fail(
    api: FakeSearchApi, second: FakeSearchApi
) -> None:
    api.answer = Answer(429, google_error(429, "Quota exceeded", "RESOURCE_EXHAUSTED"))
    second.answer = Answer(500, raw=b"down")
    search = FallbackSearch([google(api), SearxngSearch(second.base), FakeWebSearch(fail=True)])
    assert await failure(search) == (
        "every search provider failed: google: HTTP 429 (RESOURCE_EXHAUSTED Quota exceeded); "
        "searxng: HTTP 500; FakeWebSearch: web search failed: DNSError: error resolving DNS"
    )


async def test_one_provider_fails_with_its_own_message(api: FakeSearchApi) -> None:
    api.answer = Answer(500, raw=b"down")
    assert await failure(FallbackSearch([SearxngSearch(api.base)])) == "searxng: HTTP 500"


async def test_fallback_keeps_at_most_n() -> None:
    many = [SearchResult(f"T{i}", "c", f"https://w.example/{i}") for i in range(8)]
    assert len(await FallbackSearch([FakeWebSearch(many)]).search("q", 3)) == 3


def test_fallback_needs_a_provider() -> None:
    with pytest.raises(ValueError):
        FallbackSearch([])


# ---- settings ---------------------------------------------------------------------------------


def settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(data_dir=tmp_path, **values)  # type: ignore[arg-type]


def test_default_is_duckduckgo_alone(tmp_path: Path) -> None:
    search = web_search_from_settings(settings(tmp_path))
    assert search is not None and search.names == ["duckduckgo"]
    assert isinstance(search.providers[0], DdgsSearch)


def test_settings_choose_the_providers_and_their_order(tmp_path: Path) -> None:
    chosen = settings(
        tmp_path,
        search_providers=["searxng", "google", "duckduckgo"],
        search_searxng_url="http://searx.lan:8080/",
        search_google_api_key=KEY,
        search_google_engine_id=CX,
        search_google_url="http://127.0.0.1:9/customsearch/v1",
        search_timeout_s=1.5,
    )
    search = web_search_from_settings(chosen)
    assert search is not None and search.names == ["searxng", "google", "duckduckgo"]
    searx, goog, _ = search.providers
    assert isinstance(searx, SearxngSearch) and searx.url == "http://searx.lan:8080/search"
    assert isinstance(goog, GoogleSearch) and goog.url == "http://127.0.0.1:9/customsearch/v1"
    assert goog.timeout_s == 1.5 and goog.engine_id == CX
    assert KEY not in repr(chosen)


def test_search_disabled_builds_no_web_search(tmp_path: Path) -> None:
    off = settings(tmp_path, search_enabled=False, search_providers=["google"])
    assert web_search_from_settings(off) is None


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("searxng,duckduckgo", ["searxng", "duckduckgo"]),
        (" Google , searxng ", ["google", "searxng"]),
        ('["duckduckgo", "google"]', ["duckduckgo", "google"]),
    ],
)
def test_providers_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, names: list[str]
) -> None:
    monkeypatch.setenv("BRIDGE_SEARCH_PROVIDERS", value)
    monkeypatch.setenv("BRIDGE_SEARCH_GOOGLE_API_KEY", KEY)
    monkeypatch.setenv("BRIDGE_SEARCH_GOOGLE_ENGINE_ID", CX)
    monkeypatch.setenv("BRIDGE_SEARCH_SEARXNG_URL", "http://127.0.0.1:8888")
    monkeypatch.setenv("BRIDGE_DATA_DIR", str(tmp_path))
    assert load_settings().search_providers == names


def test_providers_from_a_toml_file(tmp_path: Path) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text(
        'search_providers = ["searxng", "duckduckgo"]\n'
        'search_searxng_url = "http://127.0.0.1:8888"\n'
        "kb_min_score = 5.0\n"
    )
    loaded = load_settings(config, data_dir=tmp_path)
    assert loaded.search_providers == ["searxng", "duckduckgo"] and loaded.kb_min_score == 5.0


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"search_providers": ["google"]}, "search_google_api_key"),
        ({"search_providers": ["google"], "search_google_api_key": KEY}, "engine_id"),
        ({"search_providers": ["searxng"]}, "search_searxng_url"),
        ({"search_providers": ["bing"]}, "search_providers"),
        ({"search_providers": []}, "search_providers"),
        ({"search_providers": ["duckduckgo", "duckduckgo"]}, "listed twice"),
        ({"search_providers": "[not json"}, "search_providers"),
        ({"kb_min_score": -1}, "kb_min_score"),
    ],
)
def test_unusable_search_settings_fail_at_load(
    tmp_path: Path, values: dict[str, object], complaint: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, data_dir=tmp_path, **values)
    assert complaint in str(caught.value)
    assert KEY not in str(caught.value)


# ---- the knowledge base's minimum score -------------------------------------------------------


def test_weak_knowledge_base_hits_are_dropped() -> None:
    kb = KnowledgeBase.bundled()
    weak = "Do dentists like listening to music?"  # shares only "dentist" with the check-ups
    assert kb.search(weak, 3, language="en", min_score=0.1)  # a lower floor lets it through
    assert kb.search(weak, 3, language="en") == []
    assert KnowledgeBase.bundled(min_score=0.1).search(weak, 3, language="en")
    # A real question still finds its entry, and a high floor drops even that.
    assert kb.search("how often should I floss", 3, language="en")
    assert KnowledgeBase.bundled(min_score=50).search("how often should I floss", 3) == []


@pytest.mark.parametrize(
    ("query", "language", "topic"),
    [
        ("How often should I brush?", "en", "brushing"),  # one telling word, a low BM25 score
        ("gums", "en", "gum-bleeding"),
        ("fluoride", "en", "fluoride"),
        ("my child has a toothache", "en", "toothache"),
        ("is it safe to fly after a tooth extraction", "en", "wisdom-teeth"),
        ("Is mouthwash necessary?", "en", "mouthwash"),
        ("sâu răng", "vi", "cavities"),
        ("Trẻ em mấy tuổi thì mọc răng?", "vi", "teething"),
    ],
)
def test_real_questions_keep_their_entry(query: str, language: Any, topic: str) -> None:
    kb = KnowledgeBase.bundled()
    results = kb.search(query, 2, language=language)
    assert results, query
    best = next(e for e in kb.entries if results[0].title == f"{e.title} ({e.source})")
    assert best.topic == topic and best.lang == language


@pytest.mark.parametrize(
    ("query", "language"),
    [
        ("Do dentists like listening to music?", "en"),
        ("Which music do dentists play in the waiting room?", "en"),
        ("What music does my dentist listen to?", "en"),
        ("can I drink coffee", "en"),
        ("best toothpaste brand", "en"),
        ("what is the weather today", "en"),
        ("hôm nay trời thế nào", "vi"),
        ("nha sĩ có thích âm nhạc không", "vi"),
        ("răng", "vi"),
    ],
)
def test_questions_sharing_only_common_words_get_no_entry(query: str, language: Any) -> None:
    kb = KnowledgeBase.bundled()
    assert kb.search(query, 3, language=language) == []
    assert max(kb.relevance(query)) < DEFAULT_KB_MIN_SCORE


@pytest.fixture
def fake_llm() -> Iterator[FakeLlm]:
    server = FakeLlm().start()
    yield server
    server.stop()


@pytest.fixture
async def memory(tmp_path: Path) -> AsyncIterator[SqliteMemoryStore]:
    database = Database(tmp_path / "bridge.sqlite3", CHAT_MIGRATIONS)
    await database.open()
    yield SqliteMemoryStore(database)
    await database.close()


@pytest.fixture
async def llm(fake_llm: FakeLlm) -> AsyncIterator[OpenAiProvider]:
    provider = OpenAiProvider(fake_llm.url, Usage(chat="chat", guardrail="guard"), timeout_s=5)
    yield provider
    await provider.aclose()


def sources(events: list[object]) -> Sources | None:
    return next((event for event in events if isinstance(event, Sources)), None)


async def test_weak_knowledge_base_hits_are_neither_prompted_nor_shown(
    fake_llm: FakeLlm, llm: OpenAiProvider, memory: SqliteMemoryStore
) -> None:
    question = TurnRequest(text="Do dentists like listening to music?")
    fake_llm.script("chat", Reply("Some do."), Reply("Some do."))
    loose = ChatService(memory, llm, None, KnowledgeBase.bundled(min_score=0.1))
    shown = sources(await collect(loose.run_turn(question)))
    assert shown is not None and {item.origin for item in shown.items} == {"kb"}
    assert shown.items[0].link in fake_llm.of_kind("chat")[0].messages[-1]["content"]

    strict = ChatService(memory, llm, None, KnowledgeBase.bundled())
    events = await collect(strict.run_turn(question))
    assert sources(events) is None
    prompt = fake_llm.of_kind("chat")[-1].messages[-1]["content"]
    assert shown.items[0].link not in prompt and "Link:" not in prompt
    done = events[-1]
    assert isinstance(done, Done) and done.metadata.sources == []


async def test_origins_reach_the_turns_sources(
    fake_llm: FakeLlm,
    llm: OpenAiProvider,
    memory: SqliteMemoryStore,
    api: FakeSearchApi,
    second: FakeSearchApi,
) -> None:
    api.answer = Answer(429, google_error(429, "Quota exceeded", "RESOURCE_EXHAUSTED"))
    second.answer = Answer(document=searxng_page("q", searxng_results(2)))
    web = FallbackSearch([google(api), SearxngSearch(second.base)])
    fake_llm.script("chat", Reply("Floss once a day."))
    service = ChatService(memory, llm, web)
    events = await collect(service.run_turn(TurnRequest(text="How often should I floss?")))
    shown = sources(events)
    assert shown is not None
    assert [item.origin for item in shown.items] == ["searxng", "searxng", "kb", "kb"]
    assert shown.items[0].link == "https://s.example/0"
    assert "1. SearxNG result 0 - https://s.example/0" in shown.section
    done = events[-1]
    assert isinstance(done, Done)
    assert done.metadata.search == "ok"
    assert [s.origin for s in done.metadata.sources] == ["searxng", "searxng", "kb", "kb"]
    assert "https://s.example/1" in fake_llm.of_kind("chat")[0].messages[-1]["content"]


async def test_all_providers_down_leaves_the_knowledge_base(
    fake_llm: FakeLlm, llm: OpenAiProvider, memory: SqliteMemoryStore, api: FakeSearchApi
) -> None:
    api.answer = Answer(403, google_error(403, f"API key not valid {KEY}", "PERMISSION_DENIED"))
    fake_llm.script("chat", Reply("Floss once a day."))
    service = ChatService(memory, llm, FallbackSearch([google(api)]))
    events = await collect(service.run_turn(TurnRequest(text="How often should I floss?")))
    done = events[-1]
    assert isinstance(done, Done) and done.metadata.search == "failed"
    assert (done.metadata.search_error or "").startswith("google: HTTP 403")
    assert KEY not in (done.metadata.search_error or "")
    assert {s.origin for s in done.metadata.sources} == {"kb"}


async def test_the_chat_service_is_built_with_the_configured_search(
    tmp_path: Path, memory: SqliteMemoryStore
) -> None:
    configured = settings(
        tmp_path,
        llm_provider="none",
        search_providers=["searxng", "duckduckgo"],
        search_searxng_url="http://127.0.0.1:9",
        kb_min_score=7.5,
    )
    service = ChatService.from_settings(configured, memory)
    assert isinstance(service.web, FallbackSearch)
    assert service.web.names == ["searxng", "duckduckgo"]
    assert service.knowledge.min_score == 7.5
    off = ChatService.from_settings(
        settings(tmp_path, llm_provider="none", search_enabled=False), memory
    )
    assert off.web is None
    await service.aclose()
    await off.aclose()
