"""LLM providers behind one interface (`LlmProvider`), over httpx.

`make_provider(settings)` builds the configured one, or returns None for `llm_provider = "none"`
(the pipeline then runs in offline mode).
"""

from backend.chat.errors import LlmError, LlmUnavailable
from backend.chat.llm.base import (
    Completion,
    FunctionSpec,
    LlmProvider,
    Message,
    Sampling,
    StreamEnd,
    StreamItem,
    TextDelta,
    TokenCount,
    ToolCall,
    Usage,
)
from backend.chat.llm.ollama import OllamaProvider
from backend.chat.llm.openai import OpenAiProvider
from backend.config import Settings


def make_provider(settings: Settings) -> LlmProvider | None:
    """The provider the settings name (`openai`, `ollama`), or None for `none`."""
    models = Usage(chat=settings.llm_model, guardrail=settings.guardrail_model)
    key = settings.llm_api_key.get_secret_value() if settings.llm_api_key else None
    kind = settings.llm_provider
    if kind == "none":
        return None
    cls = OpenAiProvider if kind == "openai" else OllamaProvider
    return cls(settings.llm_base_url, models, api_key=key, timeout_s=settings.llm_timeout_s)


__all__ = [
    "Completion",
    "FunctionSpec",
    "LlmError",
    "LlmProvider",
    "LlmUnavailable",
    "Message",
    "OllamaProvider",
    "OpenAiProvider",
    "Sampling",
    "StreamEnd",
    "StreamItem",
    "TextDelta",
    "TokenCount",
    "ToolCall",
    "Usage",
    "make_provider",
]
