"""`/v1/responses` as OpenAI clients use it: the official `openai` client (`client.responses`)
and LangChain's `ChatOpenAI(use_responses_api=True)`, against a real bridge on loopback whose
model is the loopback fake, or none (offline answers). Text and message input, instructions,
streaming events, `previous_response_id` over the stored conversation, `max_output_tokens`,
usage, and the refusals in OpenAI's error shape."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from backend.chat.tokens import count_tokens
from backend.server import Bridge
from testkit.llm_server import FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN
from tests.helpers import create_key

MODEL = "dental-duckduckgo"
QUESTION = "How often should I floss?"
ANSWER = "Brush twice a day for two minutes."
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
ENDING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture
async def llm_bridge(bridge_factory: Any, fake_llm: FakeLlm) -> Bridge:
    bridge: Bridge = await bridge_factory(llm_provider="openai", llm_base_url=fake_llm.url)
    return bridge


@pytest.fixture
async def offline_bridge(bridge_factory: Any) -> Bridge:
    bridge: Bridge = await bridge_factory(llm_provider="none")
    return bridge


async def client_of(bridge: Bridge, *scopes: str) -> openai.AsyncOpenAI:
    key = await create_key(bridge, *(scopes or ("chat:use",)))
    return openai.AsyncOpenAI(
        base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0, timeout=30
    )


@pytest.fixture
async def client(llm_bridge: Bridge) -> AsyncIterator[openai.AsyncOpenAI]:
    async with await client_of(llm_bridge) as made:
        yield made


@pytest.fixture
async def offline(offline_bridge: Bridge) -> AsyncIterator[openai.AsyncOpenAI]:
    async with await client_of(offline_bridge) as made:
        yield made


@pytest.fixture
async def http(llm_bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=llm_bridge.api_url, headers=headers, timeout=30) as c:
        yield c


async def streamed(client: openai.AsyncOpenAI, **fields: Any) -> list[Any]:
    stream = await client.responses.create(model=MODEL, stream=True, **fields)
    return [event async for event in stream]


def check_stream(events: list[Any], final: str = "response.completed") -> str:
    """The stream's events in OpenAI's order, numbered; the deltas join to the final text,
    which the done events and the final response all hold. Returns that text."""
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [*EVENTS, *["response.output_text.delta"] * deltas, *ENDING, final]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text
    assert events[-3].part.text == text
    assert events[-2].item.content[0].text == text
    assert events[-1].response.output_text == text
    assert events[0].response.id == events[-1].response.id
    assert events[0].response.status == "in_progress"
    return text


# ---- the official client, with the fake model -------------------------------------------------


async def test_text_input_answers_with_usage_and_is_stored(client, fake_llm, http):
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=QUESTION, instructions="Answer like a pirate."
    )
    response = raw.parse()
    assert response.status == "completed" and response.object == "response"
    assert response.output_text.startswith(ANSWER + "\n\nSources:\n1. ")
    usage = response.usage
    assert usage is not None and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The instructions sit inside the dental rules, as a chat completion's system message.
    sent = fake_llm.of_kind("chat")[0].messages
    assert (
        "<client_instructions>\nAnswer like a pirate.\n</client_instructions>"
        in (sent[0]["content"])
    )
    # The source links are url_citation annotations of the text.
    annotations = response.output[0].content[0].annotations
    assert annotations and annotations[0].type == "url_citation"
    first = annotations[0]
    assert response.output_text[first.start_index : first.end_index] == first.url
    # store defaults to true: the turn is a stored conversation, the id names it.
    conversation_id = raw.headers["x-conversation-id"]
    assert response.id == f"resp_{conversation_id}_1"
    stored = (await http.get(f"/v1/conversations/{conversation_id}")).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert stored["messages"][0]["content"] == QUESTION
    # And it reads back.
    again = await client.responses.retrieve(response.id)
    assert again.output_text == response.output_text and again.status == "completed"


async def test_message_input_with_text_parts_reaches_the_model(client, fake_llm):
    response = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Keep it short."},
            {"role": "user", "content": [{"type": "input_text", "text": "My gums bleed."}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Brush gently.", "annotations": []}],
            },
            {"role": "user", "content": QUESTION},
        ],
        store=False,
    )
    assert response.output_text.startswith(ANSWER)
    assert response.store is False and response.conversation is None
    sent = fake_llm.of_kind("chat")[0].messages
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert "Keep it short." in sent[0]["content"]
    assert sent[1]["content"] == "My gums bleed." and sent[2]["content"] == "Brush gently."
    assert QUESTION in sent[3]["content"]


async def test_a_stream_has_the_responses_events_and_its_deltas_join_to_the_text(client):
    events = await streamed(client, input=QUESTION)
    text = check_stream(events)
    assert text.startswith(ANSWER + "\n\nSources:")
    final = events[-1].response
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert (await client.responses.retrieve(final.id)).output_text == text


async def test_previous_response_id_continues_the_stored_conversation(client, fake_llm, http):
    first = await client.responses.create(model=MODEL, input=QUESTION)
    fake_llm.script("chat", Reply("Yes, daily, with a threader."))
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="Even with braces?", previous_response_id=first.id
    )
    second = raw.parse()
    assert second.output_text.startswith("Yes, daily, with a threader.")
    assert second.previous_response_id == first.id
    # The second turn saw the first: the model got it as history (without its sources).
    sent = fake_llm.of_kind("chat")[-1].messages
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == QUESTION
    assert sent[2]["content"] == ANSWER
    assert "Even with braces?" in sent[3]["content"]
    # One conversation holds both turns; each response reads back as it was.
    conversation_id = raw.headers["x-conversation-id"]
    assert first.id == f"resp_{conversation_id}_1" and second.id == f"resp_{conversation_id}_2"
    stored = (await http.get(f"/v1/conversations/{conversation_id}")).json()
    assert [m["content"] for m in stored["messages"][::2]] == [QUESTION, "Even with braces?"]
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    # Streamed, a third turn continues it too.
    fake_llm.script("chat", Reply("Every night."))
    events = await streamed(client, input="When?", previous_response_id=second.id)
    assert check_stream(events).startswith("Every night.")
    assert events[-1].response.id == f"resp_{conversation_id}_3"
    assert len(fake_llm.of_kind("chat")[-1].messages) == 6  # system, 2 turns, the question
    # Going back to an earlier response would fork the conversation: refused.
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert caught.value.code == "unsupported_parameter"
    assert caught.value.param == "previous_response_id"


async def test_store_false_keeps_nothing_and_cannot_be_continued(client, http):
    response = await client.responses.create(model=MODEL, input=QUESTION, store=False)
    assert response.output_text.startswith(ANSWER)
    assert (await http.get("/v1/conversations")).json()["total"] == 0
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.retrieve(response.id)
    assert missing.value.code == "response_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model=MODEL, input="And then?", previous_response_id=response.id
        )
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"


async def test_max_output_tokens_makes_an_incomplete_response(client, fake_llm):
    response = await client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
    assert fake_llm.of_kind("chat")[0].body["max_tokens"] == 4
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Brush twice a day"  # no room for the sources section
    assert (response.model_extra or {})["sources"]  # they are beside the text
    events = await streamed(client, input=QUESTION, max_output_tokens=4)
    assert check_stream(events, "response.incomplete") == "Brush twice a day"


REFUSED = [
    (
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]},
        "tools",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"background": True}, "background"),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
                    ],
                }
            ]
        },
        "input[0].content",
    ),
    ({"input": [{"type": "input_audio", "role": "user"}]}, "input[0]"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]},
        "input[0]",
    ),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
async def test_what_cannot_be_honoured_is_refused_in_openais_shape(client, fake_llm, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, **{"input": QUESTION, **fields})
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert caught.value.code == "unsupported_parameter"
    assert len(error["message"]) > 20  # a sentence that says why
    assert not fake_llm.requests


async def test_unknown_models_fields_and_responses_are_errors(client, fake_llm):
    with pytest.raises(openai.NotFoundError) as model:
        await client.responses.create(model="gpt-4o", input=QUESTION)
    assert model.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as field:
        await client.responses.create(model=MODEL, input=QUESTION, extra_body={"temprature": 0.2})
    assert field.value.param == "temprature"
    with pytest.raises(openai.BadRequestError) as previous:
        await client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_x")
    assert previous.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.retrieve("resp_nothing-here_1")
    assert missing.value.code == "response_not_found"
    with pytest.raises(openai.BadRequestError) as empty:
        await client.responses.create(model=MODEL, input=[{"role": "system", "content": "hi"}])
    assert empty.value.code == "invalid_request"
    assert not fake_llm.requests


async def test_the_key_needs_chat_use(llm_bridge):
    async with await client_of(llm_bridge, "devices:read") as reader:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await reader.responses.create(model=MODEL, input=QUESTION)
    assert caught.value.code == "forbidden"


# ---- offline (no model) -----------------------------------------------------------------------


async def test_offline_answers_count_their_output_tokens(offline):
    response = await offline.responses.create(model=MODEL, input=QUESTION)
    text = response.output_text
    assert text.startswith("(Offline mode")
    assert response.usage is not None
    assert response.usage.output_tokens == count_tokens(text) > 0
    events = await streamed(offline, input=QUESTION, previous_response_id=response.id)
    text = check_stream(events)
    assert events[-1].response.usage.output_tokens == count_tokens(text) > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_offline_answers_keep_to_max_output_tokens(offline, stream):
    if stream:
        events = await streamed(offline, input=QUESTION, max_output_tokens=5, store=False)
        text = check_stream(events, "response.incomplete")
        response = events[-1].response
    else:
        response = await offline.responses.create(
            model=MODEL, input=QUESTION, max_output_tokens=5, store=False
        )
        text = response.output_text
    assert response.status == "incomplete"
    assert text.startswith("(Offline mode") and count_tokens(text) <= 5
    assert response.usage.output_tokens == count_tokens(text)


# ---- LangChain --------------------------------------------------------------------------------


async def test_langchain_chat_openai_with_the_responses_api(llm_bridge, fake_llm):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    key = await create_key(llm_bridge, "chat:use")
    model = chat_openai(
        model=MODEL,
        use_responses_api=True,
        base_url=f"{llm_bridge.api_url}/v1",
        api_key=key,
        max_retries=0,
        timeout=30,
    )
    answer = await asyncio.to_thread(
        model.invoke, [("system", "Be brief."), ("human", QUESTION)]
    )  # the bridge runs on this loop
    assert answer.text.startswith(ANSWER)
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] > 0
    assert answer.response_metadata["id"].startswith("resp_")
    assert "Be brief." in fake_llm.of_kind("chat")[0].messages[0]["content"]
