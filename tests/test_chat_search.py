"""Search: the ddgs adapter through a real HTTP round trip on loopback, and the bundled
knowledge base (accent-insensitive BM25)."""

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from backend.chat.knowledge import KnowledgeBase
from backend.chat.search import (
    DdgsSearch,
    SearchFailed,
    SearchResult,
    format_results,
)

PAGE = """<html><body>
<div class="result results_links"><div class="links_main result__body">
<h2 class="result__title">
<a class="result__a" href="https://example.org/floss">Flossing daily</a></h2>
<a class="result__snippet" href="https://example.org/floss"
>Floss once a day to clean between teeth.</a>
</div></div>
<div class="result results_links"><div class="links_main result__body">
<h2 class="result__title"><a class="result__a" href="https://example.org/brush">Brushing</a></h2>
<a class="result__snippet" href="https://example.org/brush">Brush twice a day for two minutes.</a>
</div></div>
</body></html>"""


class CannedDdg:
    """A loopback stand-in for html.duckduckgo.com: canned result HTML, or an error status."""

    def __init__(self) -> None:
        self.forms: list[bytes] = []
        self.status = 200
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                owner.forms.append(self.rfile.read(length))
                data = PAGE.encode() if owner.status == 200 else b"busy"
                self.send_response(owner.status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/html/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def canned() -> Iterator[CannedDdg]:
    from ddgs.engines import ENGINES
    from ddgs.engines.duckduckgo import Duckduckgo

    server = CannedDdg()

    class LoopbackDdg(Duckduckgo):
        name = "fakeddg"
        provider = "fake"
        disabled = False
        search_url = server.url

    ENGINES["text"]["fakeddg"] = LoopbackDdg
    yield server
    del ENGINES["text"]["fakeddg"]
    server.close()


async def test_ddgs_adapter_parses_real_html_over_http(canned: CannedDdg) -> None:
    search = DdgsSearch(timeout_s=3, backend="fakeddg")
    results = await search.search("how often floss", 5)
    assert [(r.title, r.link, r.origin) for r in results] == [
        ("Flossing daily", "https://example.org/floss", "duckduckgo"),
        ("Brushing", "https://example.org/brush", "duckduckgo"),
    ]
    assert results[0].content == "Floss once a day to clean between teeth."
    assert b"q=how+often+floss" in canned.forms[0]
    assert len(await search.search("how often floss", 1)) == 1


async def test_ddgs_failure_becomes_search_failed(canned: CannedDdg) -> None:
    canned.status = 429
    with pytest.raises(SearchFailed):
        await DdgsSearch(timeout_s=3, backend="fakeddg").search("floss", 5)


async def test_ddgs_without_network_fails_cleanly(canned: CannedDdg) -> None:
    canned.close()  # connection refused, as when the internet is unreachable
    with pytest.raises(SearchFailed):
        await DdgsSearch(timeout_s=2, backend="fakeddg").search("floss", 5)


def test_format_is_title_content_link_blocks() -> None:
    text = format_results(
        [SearchResult("A", "one", "https://a"), SearchResult("B", "two", "https://b")]
    )
    assert (
        text
        == "Title: A\nContent: one\nLink: https://a\n---\nTitle: B\nContent: two\nLink: https://b"
    )


@pytest.fixture(scope="module")
def kb() -> KnowledgeBase:
    return KnowledgeBase.bundled()


def test_bundled_knowledge_base_is_bilingual_and_sourced(kb: KnowledgeBase) -> None:
    entries = kb.entries
    assert len(entries) >= 40
    topics = {e.topic for e in entries}
    for lang in ("vi", "en"):
        assert {e.topic for e in entries if e.lang == lang} == topics
    assert all(e.url.startswith("https://") and e.source for e in entries)
    assert len({e.id for e in entries}) == len(entries)


@pytest.mark.parametrize(
    ("query", "language", "topic"),
    [
        ("Một ngày nên đánh răng bao nhiêu lần?", "vi", "brushing"),
        ("mot ngay nen danh rang bao nhieu lan", "vi", "brushing"),  # typed without accents
        ("chảy máu chân răng", "vi", "gum-bleeding"),
        ("chay mau chan rang", "vi", "gum-bleeding"),
        ("RĂNG KHÔN mọc lệch", "vi", "wisdom-teeth"),
        ("how often should I floss", "en", "flossing"),
        ("my gums bleed when I brush", "en", "gum-bleeding"),
        ("is teeth whitening safe", "en", "whitening"),
        ("a tooth got knocked out", "en", "knocked-out"),
        # The form of a question is not its topic: "how long" is not the brushing entry's,
        # "bad" not bad breath's, and "get rid of" must not drown the one telling word.
        ("how long does a filling last", "en", "fillings"),
        ("how long do braces take", "en", "braces-care"),
        ("what foods are bad for my teeth", "en", "diet"),
        ("how do I get rid of plaque", "en", "tartar"),
        ("what causes bad breath", "en", "bad-breath"),
        ("how long should I brush", "en", "brushing"),
    ],
)
def test_knowledge_base_ranks_the_right_entry_first(
    kb: KnowledgeBase, query: str, language: Any, topic: str
) -> None:
    results = kb.search(query, 3, language=language)
    assert results, query
    best = next(e for e in kb.entries if e.url == results[0].link and e.lang == language)
    assert best.topic == topic
    assert all(r.origin == "kb" for r in results)


def test_knowledge_base_leaves_out_entries_that_share_only_common_words(kb: KnowledgeBase) -> None:
    # "teeth" and "brush" also occur in the dentures entry; quoting it would be off topic.
    query = "tell me how long I should brush my teeth"
    loose = kb.search(query, 3, language="en", min_share=0.0, min_cover=0.0)
    strict = kb.search(query, 3, language="en")
    assert any("Dentures" in r.title for r in loose)
    assert [r.title for r in strict] == [loose[0].title]
    assert "2 minutes" in strict[0].content


def test_knowledge_base_finds_nothing_for_nonsense(kb: KnowledgeBase) -> None:
    assert kb.search("zxqv plorp", 3) == []
