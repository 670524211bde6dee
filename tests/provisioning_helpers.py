"""What a stock device does against the bridge's provisioning: its OTA check and activation
poll (§5), and its WebSocket handshake with or without a token."""

from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from simulator import stock_ota
from testkit.stock_device import CLIENT_ID

MAC = "a4:cf:12:34:56:78"
OTHER_CLIENT = "0f8e2c61-1b7a-4c3e-9a55-7d2e0c9b1a44"

# A stock device's §5.1 request, by default of the device MAC/CLIENT_ID.
system_info = partial(stock_ota.system_info, mac=MAC, client_id=CLIENT_ID)
stock_headers = partial(stock_ota.stock_headers, mac=MAC, client_id=CLIENT_ID)


class StockOta:
    """What a stock device does against the OTA URL: check, poll activation."""

    def __init__(self, http: httpx.AsyncClient, url: str, **device: Any) -> None:
        self.http = http
        self.url = url
        self.device = device

    async def check(self, **overrides: Any) -> httpx.Response:
        device = {**self.device, **overrides}
        body_keys = {"mac", "client_id", "version"}
        body = system_info(**{k: v for k, v in device.items() if k in body_keys and v})
        return await self.http.post(self.url, json=body, headers=stock_headers(**device))

    async def activate(
        self, body: dict[str, Any] | None = None, **overrides: Any
    ) -> httpx.Response:
        url = self.url + ("activate" if self.url.endswith("/") else "/activate")
        headers = stock_headers(**{**self.device, **overrides})
        return await self.http.post(url, json=body or {}, headers=headers)


@dataclass(frozen=True, slots=True)
class Reply:
    """What a device hears: the status, a refusal's message and its Retry-After header."""

    status: int
    error: str | None = None
    retry_after: str | None = None


def http_reply(response: httpx.Response) -> Reply:
    error = response.json()["error"] if response.status_code >= 400 else None
    return Reply(response.status_code, error, response.headers.get("Retry-After"))


async def handshake_reply(
    url: str, token: str | None, device_id: str = MAC, *, source: str | None = None
) -> Reply:
    """101 when the WebSocket upgrade is accepted, else the refusal's HTTP answer; `source` is
    the local address to connect from."""
    headers = {"Device-Id": device_id, "Client-Id": CLIENT_ID, "Protocol-Version": "1"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    bind: dict[str, Any] = {} if source is None else {"local_addr": (source, 0)}
    try:
        async with connect(url, additional_headers=headers, compression=None, **bind):
            return Reply(101)
    except InvalidStatus as refused:
        answer = refused.response
        body = answer.body.decode().strip() if answer.body else None
        return Reply(answer.status_code, body, answer.headers.get("Retry-After"))


async def handshake_status(url: str, token: str | None, device_id: str = MAC) -> int:
    """101 when the WebSocket upgrade is accepted, else the refusal's HTTP status."""
    return (await handshake_reply(url, token, device_id)).status
