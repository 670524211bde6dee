"""The dental consultation assistant: one turn = guardrail → memory → search → LLM with device
tools → sources → memory with an accumulated summary (docs/chat.md).

Wiring (the core does it): open the bridge `Database` with `CHAT_MIGRATIONS` (and the keys'
migrations), build `ChatService.from_settings(settings, SqliteMemoryStore(db))`, and for each
turn `async for event in service.run_turn(TurnRequest(...))`.
"""

from backend.chat.errors import ConversationNotFound
from backend.chat.events import (
    ChatEvent,
    Done,
    Guardrail,
    SourceItem,
    Sources,
    Token,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnMetadata,
    parse_event,
)
from backend.chat.knowledge import KnowledgeBase
from backend.chat.memory import (
    CHAT_MIGRATIONS,
    Conversation,
    ConversationPage,
    MemoryStore,
    SqliteMemoryStore,
    StoredMessage,
)
from backend.chat.request import MAX_QUERY_CHARS, InputMessage, ModelName, TurnRequest
from backend.chat.search import (
    DdgsSearch,
    FallbackSearch,
    GoogleSearch,
    SearchFailed,
    SearchResult,
    SearxngSearch,
    WebSearch,
    format_results,
    web_search_from_settings,
)
from backend.chat.service import ChatService, collect
from backend.chat.tools import (
    AskBeforeChanging,
    DeviceToolBox,
    NoTools,
    ToolBox,
    ToolOutcome,
    ToolSource,
)

__all__ = [
    "CHAT_MIGRATIONS",
    "MAX_QUERY_CHARS",
    "AskBeforeChanging",
    "ChatEvent",
    "ChatService",
    "Conversation",
    "ConversationNotFound",
    "ConversationPage",
    "DdgsSearch",
    "DeviceToolBox",
    "Done",
    "FallbackSearch",
    "GoogleSearch",
    "Guardrail",
    "InputMessage",
    "KnowledgeBase",
    "MemoryStore",
    "ModelName",
    "NoTools",
    "SearchFailed",
    "SearchResult",
    "SearxngSearch",
    "SourceItem",
    "Sources",
    "SqliteMemoryStore",
    "StoredMessage",
    "Token",
    "ToolBox",
    "ToolCompleted",
    "ToolFailed",
    "ToolOutcome",
    "ToolSource",
    "ToolStarted",
    "TurnMetadata",
    "TurnRequest",
    "WebSearch",
    "collect",
    "format_results",
    "parse_event",
    "web_search_from_settings",
]
