"""LLM providers against the loopback fake that speaks the OpenAI and Ollama wire formats."""

import json
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from pydantic import SecretStr

from backend.chat.llm import (
    FunctionSpec,
    LlmError,
    LlmUnavailable,
    Message,
    OllamaProvider,
    OpenAiProvider,
    TextDelta,
    ToolCall,
    Usage,
    make_provider,
)
from backend.chat.llm.base import LlmProvider, StreamEnd, StreamItem
from backend.config import Settings
from testkit.llm_server import FakeCall, FakeLlm, Reply

MODELS = Usage(chat="chat-model", guardrail="guard-model")
VOLUME = FunctionSpec(
    "self_audio_speaker_set_volume",
    "Set the speaker volume (0-100).",
    {
        "type": "object",
        "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["volume"],
    },
)
PROVIDERS: dict[str, type[OpenAiProvider] | type[OllamaProvider]] = {
    "openai": OpenAiProvider,
    "ollama": OllamaProvider,
}


@pytest.fixture
def fake() -> Iterator[FakeLlm]:
    server = FakeLlm().start()
    yield server
    server.stop()


@pytest.fixture(params=["openai", "ollama"])
async def provider(request: pytest.FixtureRequest, fake: FakeLlm) -> AsyncIterator[LlmProvider]:
    made = PROVIDERS[request.param](fake.url, MODELS, api_key="sk-test", timeout_s=5)
    yield made
    await made.aclose()


async def drain(items: AsyncIterator[StreamItem]) -> tuple[str, list[ToolCall]]:
    text, calls, ends = [], [], []
    async for item in items:
        if isinstance(item, TextDelta):
            text.append(item.text)
        elif isinstance(item, StreamEnd):
            ends.append(item)
        else:
            calls.append(item)
    assert len(ends) == 1, "a stream that ended properly says so once, last"
    return "".join(text), calls


async def test_plain_reply(provider: LlmProvider, fake: FakeLlm) -> None:
    fake.script("chat", Reply("Twice a day."))
    reply = await provider.complete([Message("user", "How often?")])
    assert reply.text == "Twice a day." and reply.tool_calls == ()
    body = fake.requests[-1].body
    assert body["model"] == "chat-model" and body["stream"] is False
    assert body["messages"] == [{"role": "user", "content": "How often?"}]


async def test_streamed_text_arrives_in_pieces(provider: LlmProvider, fake: FakeLlm) -> None:
    fake.script("chat", Reply("Brush for two whole minutes."))
    pieces = [item async for item in provider.stream([Message("user", "q")])]
    assert isinstance(pieces.pop(), StreamEnd)
    assert len(pieces) == 5 and all(isinstance(p, TextDelta) for p in pieces)
    assert "".join(p.text for p in pieces if isinstance(p, TextDelta)) == (
        "Brush for two whole minutes."
    )
    assert fake.requests[-1].body["stream"] is True


async def test_tool_call_plain_and_streamed(provider: LlmProvider, fake: FakeLlm) -> None:
    call = FakeCall("self_audio_speaker_set_volume", {"volume": 42})
    fake.script("chat", Reply(calls=[call]), Reply(calls=[call]))
    plain = await provider.complete([Message("user", "volume 42")], tools=[VOLUME])
    _text, streamed = await drain(provider.stream([Message("user", "volume 42")], tools=[VOLUME]))
    for calls in (list(plain.tool_calls), streamed):
        assert len(calls) == 1
        assert calls[0].name == "self_audio_speaker_set_volume"
        assert calls[0].arguments == {"volume": 42} and calls[0].error is None
    sent = fake.requests[-1].body["tools"]
    assert sent == [
        {
            "type": "function",
            "function": {
                "name": VOLUME.llm_name,
                "description": VOLUME.description,
                "parameters": VOLUME.parameters,
            },
        }
    ]


async def test_openai_stream_joins_argument_fragments_by_index(fake: FakeLlm) -> None:
    calls = [
        FakeCall("a_tool", {"text": "a fairly long value to split", "n": 1}),
        FakeCall("b_tool", {"volume": 7}),
    ]
    fake.script("chat", Reply("Doing it.", calls=calls))
    provider = OpenAiProvider(fake.url, MODELS)
    text, got = await drain(provider.stream([Message("user", "x")], tools=[VOLUME]))
    await provider.aclose()
    assert text == "Doing it."
    assert [(c.id, c.name, c.arguments) for c in got] == [
        ("call_1", "a_tool", {"text": "a fairly long value to split", "n": 1}),
        ("call_2", "b_tool", {"volume": 7}),
    ]


async def test_malformed_arguments_are_returned_not_raised(
    provider: LlmProvider, fake: FakeLlm
) -> None:
    bad = FakeCall("self_audio_speaker_set_volume", '{"volume": 4')
    fake.script("chat", Reply(calls=[bad]), Reply(calls=[bad]))
    plain = await provider.complete([Message("user", "x")], tools=[VOLUME])
    _text, streamed = await drain(provider.stream([Message("user", "x")], tools=[VOLUME]))
    for calls in (list(plain.tool_calls), streamed):
        assert calls[0].arguments is None and calls[0].error
        assert calls[0].name == "self_audio_speaker_set_volume"


async def test_tool_results_go_back_in_each_wire_format(fake: FakeLlm) -> None:
    call = ToolCall("call_9", VOLUME.llm_name, {"volume": 5}, '{"volume": 5}')
    history = [
        Message("user", "volume 5"),
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", "true", tool_call_id="call_9", name=VOLUME.llm_name),
    ]
    for cls in PROVIDERS.values():
        provider = cls(fake.url, MODELS)
        await provider.complete(history, tools=[VOLUME])
        await provider.aclose()
    openai_body, ollama_body = fake.requests[-2].body, fake.requests[-1].body
    assert openai_body["messages"][1]["tool_calls"] == [
        {
            "id": "call_9",
            "type": "function",
            "function": {"name": VOLUME.llm_name, "arguments": '{"volume": 5}'},
        }
    ]
    assert openai_body["messages"][2] == {
        "role": "tool",
        "tool_call_id": "call_9",
        "content": "true",
    }
    assert ollama_body["messages"][1]["tool_calls"] == [
        {"function": {"name": VOLUME.llm_name, "arguments": {"volume": 5}}}
    ]
    assert ollama_body["messages"][2] == {
        "role": "tool",
        "tool_name": VOLUME.llm_name,
        "content": "true",
    }


async def test_api_key_is_sent_as_bearer_only_when_set(fake: FakeLlm) -> None:
    for key in ("sk-secret", None):
        provider = OpenAiProvider(fake.url, MODELS, api_key=key)
        await provider.complete([Message("user", "x")])
        await provider.aclose()
    assert fake.requests[-2].headers["authorization"] == "Bearer sk-secret"
    assert "authorization" not in fake.requests[-1].headers


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", ["openai", "ollama"])
async def test_unreachable_service_is_unavailable(kind: str) -> None:
    provider = PROVIDERS[kind](f"http://127.0.0.1:{closed_port()}", MODELS, timeout_s=2)
    with pytest.raises(LlmUnavailable):
        await provider.complete([Message("user", "x")])
    with pytest.raises(LlmUnavailable):
        await drain(provider.stream([Message("user", "x")]))
    await provider.aclose()


async def test_server_errors_are_unavailable_and_client_errors_are_not(
    provider: LlmProvider, fake: FakeLlm
) -> None:
    fake.script("chat", Reply(status=503), Reply(status=400))
    with pytest.raises(LlmUnavailable):
        await provider.complete([Message("user", "x")])
    with pytest.raises(LlmError) as caught:
        await drain(provider.stream([Message("user", "x")]))
    assert not isinstance(caught.value, LlmUnavailable)


async def test_stopped_fake_is_down(fake: FakeLlm) -> None:
    provider = OllamaProvider(fake.url, MODELS, timeout_s=2)
    fake.stop()
    with pytest.raises(LlmUnavailable):
        await provider.complete([Message("user", "x")])
    await provider.aclose()


def test_make_provider_follows_settings() -> None:
    assert make_provider(Settings(llm_provider="none")) is None
    openai = make_provider(Settings(llm_provider="openai", llm_base_url="http://h:1/v1"))
    assert isinstance(openai, OpenAiProvider) and openai.url == "http://h:1/v1/chat/completions"
    ollama = make_provider(Settings())
    assert isinstance(ollama, OllamaProvider) and ollama.url == "http://localhost:11434/api/chat"
    assert ollama.models == Usage("qwen2.5:7b-instruct", "qwen2.5:3b-instruct")
    keyed = Settings(llm_api_key=SecretStr("sk-1"))
    assert json.dumps(keyed.model_dump(mode="json")).count("sk-1") == 0
