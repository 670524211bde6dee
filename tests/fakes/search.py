"""A scripted `WebSearch` for tests (the real adapter is tested through a loopback engine)."""

from backend.chat.search import SearchFailed, SearchResult


class FakeWebSearch:
    def __init__(self, results: list[SearchResult] | None = None, *, fail: bool = False) -> None:
        self.results = results if results is not None else []
        self.fail = fail
        self.queries: list[tuple[str, int]] = []

    async def search(self, query: str, n: int) -> list[SearchResult]:
        self.queries.append((query, n))
        if self.fail:
            raise SearchFailed("web search failed: DNSError: error resolving DNS")
        return self.results[:n]
