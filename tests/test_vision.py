"""The bridge's vision endpoint: a camera board's photo upload, over real sockets on loopback.

Uploads are sent byte for byte as stock firmware sends them (`testkit.camera_upload`: chunked
multipart with its boundary) to `POST /vision/explain` on the device HTTP listener; the model is
`FakeVisionModel`, an OpenAI-compatible server on loopback that records the image it got.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from backend.server import Bridge
from backend.vision import http as vision_http
from backend.vision.service import MODEL_FAILED, NO_MODEL, VISION_PATH
from simulator.stock_ota import stock_headers, system_info
from testkit.camera_upload import (
    HttpAnswer,
    chunked,
    fake_jpeg,
    send_raw,
    stock_head,
    stock_parts,
    stock_upload,
)
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import CLIENT_ID, WireDevice, ok, text_result
from testkit.vision_model import FakeVisionModel, VisionReply
from tests.helpers import ManualClock, wait_state

MAC = "a4:cf:12:34:56:78"
OTHER = "a4:cf:12:34:56:79"
QUESTION = "What is on the table?"


@pytest.fixture
def model() -> Iterator[FakeVisionModel]:
    fake = FakeVisionModel().start()
    yield fake
    fake.stop()


def url_of(bridge: Bridge) -> str:
    return f"http://127.0.0.1:{bridge.provisioning.http_port}{VISION_PATH}"


def token_of(bridge: Bridge, device_id: str = MAC) -> str:
    return bridge.provisioning.vision.token_for(device_id)


async def upload(
    bridge: Bridge,
    *,
    device_id: str = MAC,
    token: str | None = None,
    image: bytes | None = None,
    question: str = QUESTION,
) -> HttpAnswer:
    return await stock_upload(
        url_of(bridge),
        device_id=device_id,
        client_id=CLIENT_ID,
        token=token_of(bridge, device_id) if token is None else (token or None),
        question=question,
        image=fake_jpeg(20_000) if image is None else image,
    )


async def audit_rows(bridge: Bridge) -> list[dict[str, Any]]:
    entries = await bridge.audit.entries(tool="vision.explain")
    return [entry.to_json() for entry in entries]


async def pieces(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


# ---- the stock upload ---------------------------------------------------------------------------


async def test_stock_upload_reaches_the_model_and_its_answer_comes_back(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(
        vision_base_url=model.url, vision_model="tiny-vision", vision_api_key="vision-key"
    )
    model.replies.append(VisionReply("A toothbrush next to a glass of water."))
    photo = fake_jpeg(50_000)

    answer = await upload(bridge, image=photo)

    assert answer.status == 200
    assert answer.headers["content-type"] == "application/json"
    assert json.loads(answer.body) == {
        "success": True,
        "text": "A toothbrush next to a glass of water.",
    }
    (request,) = model.requests
    assert request.path == "/v1/chat/completions"
    assert request.body["model"] == "tiny-vision"
    assert request.headers["authorization"] == "Bearer vision-key"
    assert request.question == QUESTION
    assert request.image_url.startswith("data:image/jpeg;base64,")
    assert request.image == photo  # byte for byte, multipart framing stripped
    (row,) = await audit_rows(bridge)
    assert row["device_id"] == MAC and row["actor"] == f"device:{MAC}"
    assert row["outcome"] == "ok" and row["error"] is None
    assert row["bytes"] > len(photo)  # the whole body: the photo and its multipart framing
    assert row["duration_ms"] > 0


@pytest.mark.parametrize(
    ("magic", "media_type"),
    [
        (b"\x89PNG\r\n\x1a\n", "image/png"),
        (b"GIF89a", "image/gif"),
        (b"RIFF\x00\x10\x00\x00WEBPVP8 ", "image/webp"),
        (b"BM", "image/bmp"),
    ],
)
async def test_other_image_formats_go_with_their_own_type(
    bridge_factory: Callable[..., Any], model: FakeVisionModel, magic: bytes, media_type: str
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    image = magic + bytes(range(256)) * 8
    assert (await upload(bridge, image=image)).status == 200
    assert model.requests[0].media_type == media_type
    assert model.requests[0].image == image


async def test_a_device_takes_a_photo_with_the_url_and_token_from_initialize(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    """initialize carries the endpoint and the device's own token; the device uploads with them
    when the model calls `self.camera.take_photo`, and the body comes back as the tool result."""
    bridge = await bridge_factory(vision_base_url=model.url)
    camera_tool = {
        "name": "self.camera.take_photo",
        "description": "Take a photo and explain it",
        "inputSchema": {
            "type": "object",
            "properties": {"question": {"type": "string"}},
            "required": ["question"],
        },
    }
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)
    device.tools = [*device.tools, camera_tool]
    photo = fake_jpeg(30_000)

    async def take_photo(wire: WireDevice, request: dict[str, Any]) -> dict[str, Any]:
        params = request["params"]
        if params["name"] != "self.camera.take_photo":
            return wire.stock.handle(request) or {}
        vision = next(p for p in wire.received if p.get("method") == "initialize")["params"][
            "capabilities"
        ]["vision"]
        answer = await stock_upload(
            vision["url"],
            device_id=MAC,
            client_id=CLIENT_ID,
            token=vision["token"],
            question=params["arguments"]["question"],
            image=photo,
        )
        return ok(request, text_result(answer.body.decode()))

    device.handlers["tools/call"] = take_photo
    await device.connect()
    try:
        await wait_state(bridge, MAC)
        initialize = await device.wait_for_method("initialize")
        assert initialize["params"]["capabilities"]["vision"] == {
            "url": url_of(bridge),
            "token": token_of(bridge),
        }
        async with httpx.AsyncClient(
            base_url=bridge.api_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as api:
            response = await api.post(
                f"/api/devices/{MAC}/tools/call",
                json={"name": "self.camera.take_photo", "arguments": {"question": "Who is it?"}},
            )
        assert response.status_code == 200
        text = response.json()["content"][0]["text"]
        assert json.loads(text) == {"success": True, "text": VisionReply().text}
        assert model.requests[0].image == photo
        assert model.requests[0].question == "Who is it?"
    finally:
        await device.close()


async def test_an_external_vision_url_is_still_forwarded_as_configured(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge = await bridge_factory(
        vision_url="http://vision.example:9000/explain", vision_token="external-token"
    )
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)
    await device.connect()
    try:
        initialize = await device.wait_for_method("initialize")
        assert initialize["params"]["capabilities"]["vision"] == {
            "url": "http://vision.example:9000/explain",
            "token": "external-token",
        }
    finally:
        await device.close()


async def test_approved_device_gets_the_host_it_used_for_ota_and_a_revoked_one_is_refused(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    """device_auth = "device": the vision URL uses the host the device reached the OTA endpoint
    at; the token works while the device is approved, and not after it is revoked."""
    bridge = await bridge_factory(
        device_auth="device", activation_auto_approve_macs=["a4:cf"], vision_base_url=model.url
    )
    port = bridge.provisioning.http_port
    async with httpx.AsyncClient() as http:
        response = await http.post(
            bridge.provisioning.ota_url,
            json=system_info(MAC, CLIENT_ID),
            headers={**stock_headers(MAC, CLIENT_ID), "Host": f"localhost:{port}"},
        )
        ws_token = response.json()["websocket"]["token"]
        # A stranger with the device's MAC and a Host of its own must not move its uploads.
        stranger = "00000000-0000-4000-8000-00000000dead"
        await http.post(
            bridge.provisioning.ota_url,
            json=system_info(MAC, stranger),
            headers={**stock_headers(MAC, stranger), "Host": f"evil.example:{port}"},
        )
    device = WireDevice(bridge.ws_url, ws_token, MAC)
    await device.connect()
    try:
        vision = (await device.wait_for_method("initialize"))["params"]["capabilities"]["vision"]
    finally:
        await device.close()
    assert vision["url"] == f"http://localhost:{port}{VISION_PATH}"
    assert vision["token"] == token_of(bridge) and vision["token"] != ws_token
    assert (await upload(bridge, token=vision["token"])).status == 200
    assert (await upload(bridge, token=ws_token)).status == 401  # the transport token: no
    await bridge.provisioning.revoke(MAC, by="test")
    refused = await upload(bridge, token=vision["token"])
    assert refused.status == 401
    assert "not approved" in json.loads(refused.body)["error"]
    assert len(model.requests) == 1


# ---- who may upload -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        ("", "missing Authorization"),
        ("vtk_not-the-right-one", "not this device's"),
        (DEVICE_TOKEN, "not this device's"),
        (ADMIN_TOKEN, "not this device's"),
    ],
)
async def test_wrong_or_missing_token_is_401_and_reaches_no_model(
    bridge_factory: Callable[..., Any], model: FakeVisionModel, token: str, reason: str
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    answer = await upload(bridge, token=token)
    assert answer.status == 401
    assert answer.headers["www-authenticate"].startswith("Bearer")
    body = json.loads(answer.body)
    assert body["success"] is False and reason in body["error"]
    assert model.requests == []
    (row,) = await audit_rows(bridge)
    assert row["outcome"] == "unauthorized"


async def test_another_devices_token_is_refused(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    assert token_of(bridge, OTHER) != token_of(bridge, MAC)
    answer = await upload(bridge, device_id=MAC, token=token_of(bridge, OTHER))
    assert answer.status == 401
    assert model.requests == []
    assert (await upload(bridge, device_id=OTHER, token=token_of(bridge, OTHER))).status == 200


async def test_missing_or_malformed_device_id_is_401(bridge_factory: Callable[..., Any]) -> None:
    bridge = await bridge_factory()
    for device_id in ("", "not a device id\x01"):
        answer = await upload(bridge, device_id=device_id, token="x")
        assert answer.status == 401
        assert "Device-Id" in json.loads(answer.body)["error"]
    assert await audit_rows(bridge) == []  # no device to write a row for


# ---- what is uploaded ---------------------------------------------------------------------------


async def test_declared_oversize_is_413_before_the_body_is_read(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url, vision_max_bytes=64 * 1024)
    head = stock_head(url_of(bridge), device_id=MAC, client_id=CLIENT_ID, token=token_of(bridge))
    head = head.replace(b"Transfer-Encoding: chunked", b"Content-Length: 10000000")

    # Only the head is sent: the answer comes without a byte of the 10 MB body.
    answer = await send_raw(url_of(bridge), head, pieces())

    assert answer.status == 413
    assert "larger than 65536 bytes" in json.loads(answer.body)["error"]
    assert model.requests == []
    (row,) = await audit_rows(bridge)
    assert (row["outcome"], row["bytes"]) == ("too_large", 0)


async def test_chunked_oversize_is_413_at_the_chunk_that_crosses_the_cap(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    cap = 64 * 1024
    bridge = await bridge_factory(vision_base_url=model.url, vision_max_bytes=cap)
    head = stock_head(url_of(bridge), device_id=MAC, client_id=CLIENT_ID, token=token_of(bridge))
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        """A photo that never ends: the answer must come while it is still being sent."""
        for piece in stock_parts(QUESTION, fake_jpeg(4096), chunk=4096)[:2]:
            yield chunked([piece], last=False)
        while True:
            sent.append(4096)
            yield chunked([b"\xab" * 4096], last=False)

    answer = await send_raw(url_of(bridge), head, endless())

    assert answer.status == 413
    assert answer.headers["connection"] == "close"  # the rest of the body is not read
    assert model.requests == []
    (row,) = await audit_rows(bridge)
    assert row["outcome"] == "too_large"
    assert cap < row["bytes"] <= cap + 64 * 1024  # read up to the crossing read, no further


async def test_a_file_that_is_not_an_image_is_415(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    answer = await upload(bridge, image=b"#!/bin/sh\nrm -rf /\n" * 100)
    assert answer.status == 415
    assert "not a JPEG, PNG, GIF, WebP or BMP" in json.loads(answer.body)["error"]
    assert model.requests == []
    assert (await audit_rows(bridge))[0]["outcome"] == "not_image"


@pytest.mark.parametrize(
    ("content_type", "body", "fragment"),
    [
        ("application/json", b'{"question": "hi"}', "multipart/form-data"),
        ("multipart/form-data", b"", "boundary"),
        (
            "multipart/form-data; boundary=XX",
            b'--XX\r\nContent-Disposition: form-data; name="question"\r\n\r\nhi\r\n--XX--\r\n',
            "no 'file' part",
        ),
        (
            "multipart/form-data; boundary=XX",
            b'--XX\r\nContent-Disposition: form-data; name="file"\r\n\r\n\xff\xd8\xff\xe0 cut off',
            "ends before",
        ),
        ("multipart/form-data; boundary=XX", b"not multipart at all", "malformed"),
    ],
)
async def test_malformed_bodies_are_400(
    bridge_factory: Callable[..., Any],
    model: FakeVisionModel,
    content_type: str,
    body: bytes,
    fragment: str,
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    async with httpx.AsyncClient() as http:
        response = await http.post(
            url_of(bridge),
            content=body,
            headers={
                "Device-Id": MAC,
                "Client-Id": CLIENT_ID,
                "Authorization": f"Bearer {token_of(bridge)}",
                "Content-Type": content_type,
            },
        )
    assert response.status_code == 400
    assert fragment in response.json()["error"]
    assert model.requests == []


async def test_an_upload_that_stalls_is_given_up(
    bridge_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vision_http, "BODY_DEADLINE_S", 0.3)
    bridge = await bridge_factory()
    head = stock_head(url_of(bridge), device_id=MAC, client_id=CLIENT_ID, token=token_of(bridge))
    never = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield chunked(stock_parts(QUESTION, b"")[:2], last=False)
        await never.wait()  # the camera hangs mid-upload
        yield b""

    answer = await send_raw(url_of(bridge), head, stalls())
    assert answer.status == 408
    assert answer.headers["connection"] == "close"
    assert "did not arrive" in json.loads(answer.body)["error"]


# ---- the model ----------------------------------------------------------------------------------


async def test_without_a_vision_model_the_device_hears_a_clear_sentence(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge = await bridge_factory()  # no vision_base_url
    answer = await upload(bridge)
    assert answer.status == 200
    assert json.loads(answer.body) == {"success": False, "text": NO_MODEL}
    assert "no vision model is configured" in NO_MODEL
    (row,) = await audit_rows(bridge)
    assert (row["outcome"], row["error"]) == ("no_model", "no vision model")


async def test_a_model_that_is_down_or_fails_gives_a_clear_sentence(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(
        vision_base_url=model.url,
        vision_timeout_s=0.5,
        rate_limits={"vision_device": {"per_s": 1, "burst": 10}},
    )
    model.replies.extend(
        [
            VisionReply(status=500, raw=b'{"error": "overloaded"}'),
            VisionReply(raw=b"<html>not json</html>"),
            VisionReply(raw=b'{"choices": []}'),
            VisionReply(delay_s=5.0),  # past vision_timeout_s
        ]
    )
    for _ in range(4):
        answer = await upload(bridge)
        assert answer.status == 200
        assert json.loads(answer.body) == {"success": False, "text": MODEL_FAILED}
    model.stop()  # the model is down: connection refused
    answer = await upload(bridge)
    assert (answer.status, json.loads(answer.body)["text"]) == (200, MODEL_FAILED)
    rows = await audit_rows(bridge)
    assert [row["outcome"] for row in rows] == ["error"] * 5


async def test_uploads_are_rate_limited_per_device(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    clock = ManualClock()
    bridge = await bridge_factory(
        clock=clock,
        vision_base_url=model.url,
        rate_limits={"vision_device": {"per_s": 0.5, "burst": 2}},
    )
    statuses = [(await upload(bridge)).status for _ in range(3)]
    assert statuses == [200, 200, 429]
    limited = await upload(bridge)
    assert limited.headers["retry-after"] == "10"
    assert "too many uploads from this device" in json.loads(limited.body)["error"]
    # Another device has a budget of its own.
    assert (await upload(bridge, device_id=OTHER)).status == 200
    clock.advance(2.0)
    assert (await upload(bridge)).status == 200
    assert len(model.requests) == 4
    outcomes = [row["outcome"] for row in reversed(await audit_rows(bridge))]
    assert outcomes == ["ok", "ok", "refused", "refused", "ok", "ok"]


async def test_a_flood_of_bad_tokens_does_not_spend_the_devices_budget(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(
        vision_base_url=model.url, rate_limits={"vision_device": {"per_s": 0.01, "burst": 1}}
    )
    for _ in range(5):
        assert (await upload(bridge, token="vtk_guess")).status == 401
    assert (await upload(bridge)).status == 200


async def test_a_flood_from_one_address_is_limited_whatever_device_it_claims(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge = await bridge_factory(
        rate_limit_exempt=[], rate_limits={"vision_ip": {"per_s": 0.01, "burst": 2}}
    )
    devices = [f"a4:cf:00:00:00:{index:02x}" for index in range(4)]
    statuses = [(await upload(bridge, device_id=device)).status for device in devices]
    assert statuses == [200, 200, 429, 429]  # 200: no model configured, the sentence


async def test_the_vision_token_never_reaches_the_logs(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    from structlog.testing import capture_logs

    bridge = await bridge_factory(vision_base_url=model.url, vision_api_key="vision-key")
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)
    with capture_logs() as logs:
        await device.connect()
        try:
            await wait_state(bridge, MAC)
            assert (await upload(bridge)).status == 200
            assert (await upload(bridge, token="vtk_wrong-guess")).status == 401
        finally:
            await device.close()
    assert any(entry.get("event") == "vision upload" for entry in logs)
    for secret in (token_of(bridge), "vtk_wrong-guess", "vision-key"):
        assert secret not in repr(logs)


async def test_a_device_that_goes_away_mid_upload_leaves_an_audit_row_and_no_error(
    bridge_factory: Callable[..., Any], model: FakeVisionModel
) -> None:
    bridge = await bridge_factory(vision_base_url=model.url)
    head = stock_head(url_of(bridge), device_id=MAC, client_id=CLIENT_ID, token=token_of(bridge))
    _reader, writer = await asyncio.open_connection("127.0.0.1", bridge.provisioning.http_port)
    writer.write(head + chunked(stock_parts(QUESTION, fake_jpeg(8192))[:3], last=False))
    await writer.drain()
    writer.close()  # the camera loses Wi-Fi mid-photo
    await writer.wait_closed()

    async def audited() -> list[dict[str, Any]]:
        while not (rows := await audit_rows(bridge)):  # noqa: ASYNC110 - rows have no event
            await asyncio.sleep(0.01)
        return rows

    (row,) = await asyncio.wait_for(audited(), 10)
    assert row["outcome"] == "bad_request"
    assert row["error"] == "the device went away during the upload"
    assert model.requests == []
    assert (await upload(bridge)).status == 200  # and the endpoint goes on
