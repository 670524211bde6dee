"""The HTTP API's surface as clients see it: OpenAI's error shape and status codes under `/v1`
(the official `openai` client raising the error class OpenAI's API would make it raise), the
admin routes' errors in the same shape, 405 with `Allow`, `/.well-known/...` answered 404 without
a key, CORS off by default and open to listed origins, and an OpenAPI document that says all
of it. A real bridge on loopback; devices speak the real wire format."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from backend.api.errors import error_type, openai_status, param_of
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from testkit.stock_device import WireDevice, hang_and_signal
from tests.helpers import create_key, eventually, wait_state

MODEL = "dental-duckduckgo"
QUESTION = "How long should I brush my teeth?"
ORIGIN = "https://clinic.example"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ERROR_FIELDS = {"message", "type", "param", "code"}


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object, checked to have exactly OpenAI's four fields."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return error


@pytest.fixture
async def client(bridge: Bridge) -> AsyncIterator[openai.AsyncOpenAI]:
    key = await create_key(bridge, "chat:use")
    async with openai.AsyncOpenAI(
        base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0, timeout=30
    ) as client:
        yield client


async def ask(client: openai.AsyncOpenAI, **body: Any) -> Any:
    values: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    return await client.chat.completions.create(**{**values, **body})


# ---- the openai SDK's error classes ---------------------------------------------------------


@pytest.mark.parametrize(
    "messages, param, code",
    [
        ([], "messages", "invalid_request"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_request"),
        ([{"role": "user"}, {"content": "x"}], "messages[1].role", "invalid_request"),
        ([{"role": "system", "content": "hi"}], "messages", "invalid_request"),
        ([{"role": "user", "content": "x" * 4001}], "messages", "context_length_exceeded"),
    ],
)
async def test_a_bad_request_is_bad_request_error_naming_the_field(
    client: openai.AsyncOpenAI, messages: list[Any], param: str, code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await ask(client, messages=messages)
    assert caught.value.status_code == 400
    error = error_of(caught.value.response)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert caught.value.code == code and caught.value.param == param


async def test_a_body_that_is_not_json_is_400(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=ADMIN) as http:
        for content in (b"{", b"[]", b'"text"', b"\xff\xfe"):
            response = await http.post(
                "/v1/chat/completions",
                content=content,
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, (content, response.text)
            assert error_of(response)["type"] == "invalid_request_error"


async def test_a_bad_key_is_authentication_error(bridge: Bridge) -> None:
    for key in ("esk_000000000000_forged", "not-a-key", "x" * 5000):
        async with openai.AsyncOpenAI(
            base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0
        ) as bad:
            with pytest.raises(openai.AuthenticationError) as caught:
                await bad.models.list()
        error = error_of(caught.value.response)
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert caught.value.response.headers["www-authenticate"] == "Bearer"


async def test_a_key_without_chat_use_is_permission_denied(bridge: Bridge) -> None:
    key = await create_key(bridge, "devices:read")
    async with openai.AsyncOpenAI(
        base_url=f"{bridge.api_url}/v1", api_key=key, max_retries=0
    ) as reader:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await ask(reader)
    error = error_of(caught.value.response)
    assert (error["type"], error["code"]) == ("permission_error", "forbidden")


async def test_an_unknown_model_is_not_found_error(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await ask(client, model="gpt-4o")
    assert error_of(caught.value.response)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as retrieved:
        await client.models.retrieve("gpt-4o")
    error = error_of(retrieved.value.response)
    assert (error["type"], error["code"]) == ("not_found_error", "model_not_found")


async def test_unknown_and_invalid_conversation_ids(bridge: Bridge, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.get("/conversations/nothing-here", cast_to=object)
    assert error_of(caught.value.response)["code"] == "unknown_conversation"
    for bad in ("-starts-with-a-dash", "spa ce", "x" * 129, "%C3%A9"):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.get(f"/conversations/{bad}", cast_to=object)
        assert error_of(refused.value.response)["param"] == "conversation_id", bad


async def test_an_offline_device_is_a_server_error(bridge: Bridge, client: Any) -> None:
    device = WireDevice(bridge.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:09")
    await device.connect()
    await wait_state(bridge, device.device_id)
    await device.close()
    await eventually(lambda: bridge.registry.get(device.device_id) is None)
    with pytest.raises(openai.InternalServerError) as caught:
        await ask(client, extra_body={"device_id": device.device_id})
    assert caught.value.status_code == 503
    error = error_of(caught.value.response)
    assert (error["type"], error["code"]) == ("server_error", "device_offline")
    with pytest.raises(openai.NotFoundError):
        await ask(client, extra_body={"device_id": "ff:ff:ff:ff:ff:ff"})


async def test_a_busy_device_is_rate_limit_error_with_retry_after(bridge_factory: Any) -> None:
    bridge: Bridge = await bridge_factory(max_pending_calls=1)
    device = WireDevice(bridge.ws_url, "device-secret-token-for-tests", "a4:cf:00:00:00:07")
    reached = asyncio.Event()
    device.handlers["tools/call"] = hang_and_signal(reached)
    await device.connect()
    await wait_state(bridge, device.device_id)
    url = f"{bridge.api_url}/api/devices/{device.device_id}/tools/call"
    call = {"name": "self.get_device_status", "timeout_s": 30}
    async with (
        httpx.AsyncClient(headers=ADMIN, timeout=30) as http,
        openai.AsyncOpenAI(
            base_url=f"{bridge.api_url}/v1", api_key=ADMIN_TOKEN, max_retries=0
        ) as sdk,
    ):
        hung = asyncio.create_task(http.post(url, json=call))
        await asyncio.wait_for(reached.wait(), 10)
        with pytest.raises(openai.RateLimitError) as caught:
            await sdk.post(url, body=call, cast_to=object)
        hung.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hung
    await device.close()
    assert caught.value.response.headers["retry-after"] == "1"
    error = error_of(caught.value.response)
    assert (error["type"], error["code"]) == ("rate_limit_error", "device_busy")


async def test_an_oversized_body_is_413_in_the_same_shape(bridge: Bridge) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=ADMIN) as http:
        response = await http.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert error_of(response)["code"] == "body_too_large"


# ---- every /v1 route and the admin routes answer errors in one shape ---------------------------


async def test_every_v1_route_answers_errors_in_openai_shape(bridge: Bridge) -> None:
    reader = await create_key(bridge, "devices:read")
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        document = (await http.get("/openapi.json")).json()
        operations = [
            (method.upper(), path.replace("{model}", "m").replace("{conversation_id}", "c1"))
            for path, ops in document["paths"].items()
            if path.startswith("/v1/")
            for method in ops
        ]
        assert len(operations) >= 6
        for method, path in operations:
            body = {} if method == "POST" else None
            for headers, status, code in (
                ({}, 401, "invalid_api_key"),
                ({"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
                ({"Authorization": f"Bearer {reader}"}, 403, "forbidden"),
            ):
                response = await http.request(method, path, json=body, headers=headers)
                assert response.status_code == status, (method, path, response.text)
                assert error_of(response)["code"] == code
        bad = await http.get("/v1/conversations?limit=0", headers=ADMIN)
        assert bad.status_code == 400 and error_of(bad)["param"] == "limit"
        missing = await http.get("/v1/nothing", headers=ADMIN)
        assert missing.status_code == 404 and error_of(missing)["type"] == "not_found_error"


async def test_admin_routes_keep_their_codes_in_the_same_shape(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        unauthorized = await http.get("/api/devices")
        assert unauthorized.status_code == 401
        assert error_of(unauthorized)["code"] == "unauthorized"
        invalid = await http.post("/api/keys", json={"name": "", "scopes": []}, headers=ADMIN)
        assert invalid.status_code == 422
        error = error_of(invalid)
        assert (error["code"], error["param"]) == ("invalid_request", "name")
        unknown = await http.get("/api/devices/ff:ff:ff:ff:ff:ff", headers=ADMIN)
        assert error_of(unknown)["type"] == "not_found_error"


async def test_a_wrong_method_is_405_with_allow(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=ADMIN) as http:
        for method, path, allowed in (
            ("GET", "/v1/chat/completions", {"POST"}),
            ("PUT", "/v1/models", {"GET"}),
            ("GET", "/api/devices/x/tools/call", {"POST"}),
            ("PATCH", "/api/keys", {"GET", "POST"}),
        ):
            response = await http.request(method, path)
            assert response.status_code == 405, (method, path)
            allow = set(response.headers["allow"].replace(" ", "").split(","))
            assert allow >= allowed, (method, path, response.headers)
            assert error_of(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path",
    [
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-authorization-server",
    ],
)
async def test_well_known_probes_are_404_without_a_key(bridge: Bridge, path: str) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        response = await http.get(path)
        with_bad_key = await http.get(path, headers={"Authorization": "Bearer wrong"})
    for answer in (response, with_bad_key):
        assert answer.status_code == 404, answer.text
        assert "www-authenticate" not in answer.headers
        assert error_of(answer)["code"] == "http_error"


# ---- CORS --------------------------------------------------------------------------------------


def preflight(origin: str = ORIGIN, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type",
    }


async def test_cors_is_off_by_default(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        answer = await http.get("/v1/models", headers={**ADMIN, "Origin": ORIGIN})
        asked = await http.options("/v1/chat/completions", headers=preflight())
    assert answer.status_code == 200
    for response in (answer, asked):
        assert not any(name.startswith("access-control-") for name in response.headers)
    assert asked.status_code == 401  # no preflight handling: the gate wants a key


async def test_cors_opens_to_listed_origins_only(bridge_factory: Any) -> None:
    bridge: Bridge = await bridge_factory(cors_origins=[ORIGIN])
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        asked = await http.options("/v1/chat/completions", headers=preflight())
        assert asked.status_code == 200  # no key needed for the preflight
        assert asked.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in asked.headers["access-control-allow-headers"].lower()
        answer = await http.get("/v1/models", headers={**ADMIN, "Origin": ORIGIN})
        assert answer.headers["access-control-allow-origin"] == ORIGIN
        refused = await http.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # the call itself still needs the key...
        assert refused.headers["access-control-allow-origin"] == ORIGIN  # ...readable by the page
        stranger = await http.options(
            "/v1/chat/completions", headers=preflight("https://evil.example")
        )
        assert stranger.status_code == 400
        assert "access-control-allow-origin" not in stranger.headers
        other = await http.get("/v1/models", headers={**ADMIN, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_a_preflight_flood_from_a_stranger_gets_nothing(bridge_factory: Any) -> None:
    bridge: Bridge = await bridge_factory(cors_origins=[ORIGIN])
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        answers = await asyncio.gather(
            *(
                http.options("/api/keys", headers=preflight(f"https://x{n}.example", "DELETE"))
                for n in range(200)
            )
        )
        still = await http.get("/healthz")
    assert {answer.status_code for answer in answers} == {400}
    assert not any("access-control-allow-origin" in answer.headers for answer in answers)
    assert still.status_code == 200


# ---- the OpenAPI document says it ------------------------------------------------------------


async def test_the_openapi_document_tells_the_truth(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as http:
        document = (await http.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorDetail"]["properties"]) == ERROR_FIELDS
    assert "HTTPValidationError" not in schemas
    paths = document["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation["responses"]
            where = (method, path)
            assert "500" in responses, where
            takes_input = "requestBody" in operation or operation.get("parameters")
            if path.startswith("/v1/"):
                assert "422" not in responses, where
            if takes_input:
                assert "400" in responses, where
            if path not in ("/livez", "/readyz", "/healthz", "/openapi.json"):  # open
                assert {"401", "403"} <= set(responses), where
            for status, answer in responses.items():
                if int(status) >= 400:
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorBody"}, where
    completions = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"application/json", "text/event-stream"} <= set(completions["200"]["content"])
    assert {"404", "413", "503"} <= set(completions)
    responses = paths["/v1/responses"]["post"]["responses"]
    assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
    assert {"404", "413", "503"} <= set(responses)
    assert "404" in paths["/v1/responses/{response_id}"]["get"]["responses"]
    assert "text/event-stream" in paths["/api/chat/stream"]["post"]["responses"]["200"]["content"]
    plain = paths["/api/provisioning/mosquitto-passwd"]["get"]["responses"]["200"]["content"]
    assert set(plain) == {"text/plain"}
    call = paths["/api/devices/{device_id}/tools/call"]["post"]["responses"]
    assert {"404", "409", "422", "428", "429", "502", "503", "504"} <= set(call)
    assert "Retry-After" in call["429"]["headers"]
    conversation = _param(paths["/v1/conversations/{conversation_id}"]["get"], "conversation_id")
    assert conversation["maxLength"] == 128 and conversation["pattern"].startswith("^[A-Za-z0-9]")
    serial = _param(paths["/api/provisioning/serial-keys/{serial}"]["put"], "serial")
    assert serial["maxLength"] == 64
    upload = paths["/api/firmware/{board}/{version}"]["put"]
    assert "pattern" in _param(upload, "board") and "pattern" in _param(upload, "version")
    assert "application/octet-stream" in upload["requestBody"]["content"]
    key_name = schemas["KeyCreate"]["properties"]["name"]
    assert (key_name["minLength"], key_name["maxLength"]) == (1, 100)
    publish = schemas["PublishRequest"]["properties"]
    assert "absolute" in publish["path"]["description"] and "pattern" in publish["board"]


def _param(operation: dict[str, Any], name: str) -> dict[str, Any]:
    found = next(p for p in operation["parameters"] if p["name"] == name)
    schema: dict[str, Any] = found["schema"]
    return schema


# ---- a bug is a 500 in the same shape, without its details --------------------------------------


async def test_an_unexpected_error_is_a_server_error(
    bridge: Bridge, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("secret detail of a bug")

    monkeypatch.setattr(bridge.frontends.memory, "list_conversations", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        await client.get("/conversations", cast_to=object)
    error = error_of(caught.value.response)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "secret" not in caught.value.response.text


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "invalid_request_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_error_types_follow_openai(status: int, kind: str) -> None:
    assert error_type(status) == kind


def test_param_and_status_under_v1() -> None:
    assert param_of(("body", "messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    assert param_of(("query", "limit")) == "limit" and param_of(("body",)) is None
    assert openai_status("/v1/chat/completions", 422, "invalid_request") == (400, "invalid_request")
    assert openai_status("/v1/models", 401, "unauthorized") == (401, "invalid_api_key")
    assert openai_status("/api/keys", 422, "invalid_request") == (422, "invalid_request")
    assert openai_status("/v1x", 422, "x") == (422, "x")  # only the /v1/ routes
