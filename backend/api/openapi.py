"""What the OpenAPI document says beyond FastAPI's defaults: streamed answers, and the checks
the code makes elsewhere, as parameter schemas (so a client, or schemathesis, knows them)."""

from typing import Annotated, Any

from fastapi import Path

from backend.api.errors import errors
from backend.chat.errors import MAX_ID_LENGTH

# backend/chat/memory.py's check_conversation_id: ids travel in headers and URLs. An id that
# cannot exist is a bad request (400 under /v1) rather than a lookup.
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]*$"
ConversationIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=CONVERSATION_ID_PATTERN,
        description="ASCII letters, digits or ._:@- (starting with a letter or digit)",
    ),
]

# One Server-Sent Event (the schema a validator applies to each event of the stream): `data`
# is a JSON object, or `[DONE]` at the end of an OpenAI stream.
_SSE: dict[str, Any] = {
    "schema": {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": "a JSON object, or [DONE]"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    },
}


def streamed(*statuses: int, json_too: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route answering Server-Sent Events (and, with `json_too`, one JSON
    object when the request does not ask for a stream), plus its error statuses."""
    content: dict[str, Any] = {"text/event-stream": _SSE}
    if json_too:
        content = {"application/json": {"schema": {"type": "object"}}, **content}
    return {200: {"description": "the answer", "content": content}, **errors(*statuses)}


# Body fields whose check lives in the code that uses them (check_conversation_id), keyed by
# (component, property): said in the document, so the schema allows what the code allows.
_CHECKED_FIELDS: dict[tuple[str, str], dict[str, Any]] = {
    ("CompletionRequest", "chat_id"): {"pattern": CONVERSATION_ID_PATTERN},
    ("StreamRequest", "conversationId"): {"pattern": CONVERSATION_ID_PATTERN},
}


def add_checked_constraints(document: dict[str, Any]) -> None:
    """Put the constraints of `_CHECKED_FIELDS` on the string branch of each field's schema."""
    schemas = document.get("components", {}).get("schemas", {})
    for (component, name), extra in _CHECKED_FIELDS.items():
        field = schemas.get(component, {}).get("properties", {}).get(name)
        if field is None:
            continue
        for branch in field.get("anyOf", [field]):
            if branch.get("type") == "string":
                branch.update(extra)
