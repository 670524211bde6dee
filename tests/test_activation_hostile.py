"""Strangers against activation, over real loopback HTTP (issue 16, "Activation can be blocked
by strangers"): a flood of pending requests from one address or prefix, a stranger claiming a
device's MAC with Client-Ids of its own, and a stranger spending an approved device's OTA
budget. Each test asserts that the attack was contained and that the victim, asking as stock
firmware does, still activates or is still answered.

Other addresses are other loopback addresses (Linux routes all of 127.0.0.0/8 to `lo`):
127.0.0.x is one /24, 127.0.1.x another. `rate_limit_exempt = []` so loopback is treated as
any other network.
"""

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from backend.provisioning.pending import MAX_PENDING_PER_DEVICE
from backend.server import Bridge
from simulator.stock_ota import stock_headers, system_info
from testkit.settings import ADMIN_TOKEN
from tests.helpers import ManualClock, can_bind, run_cli

VICTIM = "a4:cf:12:34:56:78"
VICTIM_CLIENT = "7d2e0c9b-1a44-4c3e-9a55-0f8e2c611b7a"
VICTIM_ADDRESS = "127.0.1.2"  # another /24 than the strangers' 127.0.0.x


pytestmark = pytest.mark.skipif(
    not (can_bind("127.0.0.2") and can_bind(VICTIM_ADDRESS)),
    reason="needs several loopback addresses (Linux routes 127.0.0.0/8 to lo)",
)


class Sources:
    """An HTTP client per local address, opened on first use and closed at the end."""

    def __init__(self, stack: AsyncExitStack) -> None:
        self._stack = stack
        self._clients: dict[str, httpx.AsyncClient] = {}

    async def __call__(self, address: str) -> httpx.AsyncClient:
        client = self._clients.get(address)
        if client is None:
            transport = httpx.AsyncHTTPTransport(local_address=address)
            client = httpx.AsyncClient(timeout=10, transport=transport)
            self._clients[address] = await self._stack.enter_async_context(client)
        return client


@pytest.fixture
async def sources() -> AsyncIterator[Sources]:
    async with AsyncExitStack() as stack:
        yield Sources(stack)


async def check(
    sources: Sources, bridge: Bridge, address: str, mac: str, client_id: str
) -> httpx.Response:
    """A stock OTA check (§5.1 headers and body) from `address`."""
    http = await sources(address)
    return await http.post(
        bridge.provisioning.ota_url,
        json=system_info(mac, client_id),
        headers=stock_headers(mac, client_id),
    )


async def poll(sources: Sources, bridge: Bridge, address: str, mac: str, client_id: str) -> int:
    """A stock activation poll (§5.3, no serial number) from `address`: its status."""
    http = await sources(address)
    url = bridge.provisioning.ota_url + "activate"
    return (await http.post(url, json={}, headers=stock_headers(mac, client_id))).status_code


async def approve(bridge: Bridge, target: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as admin:
        return await admin.post("/api/provisioning/approve", json={"target": target})


def stranger_mac(index: int) -> str:
    return f"02:66:00:00:{index // 256:02x}:{index % 256:02x}"


# ---- the pending table, shared out by address and prefix ----------------------------------------


async def test_one_address_and_one_prefix_hold_only_their_share_and_a_device_elsewhere_activates(
    bridge_factory: Callable[..., Any], sources: Sources
) -> None:
    # 256 pending in all: 4 per address, 16 per /24 (max_pending // 64, // 16).
    bridge: Bridge = await bridge_factory(
        device_auth="device", rate_limit_exempt=[], max_pending_activations=256
    )
    store = bridge.provisioning.store
    assert (store.per_address, store.per_prefix) == (4, 16)
    # One address invents 10 devices: its share, then 503 (the device retries later).
    flood = [
        await check(sources, bridge, "127.0.0.2", stranger_mac(i), str(uuid.uuid4()))
        for i in range(10)
    ]
    assert [answer.status_code for answer in flood] == [200] * 4 + [503] * 6
    assert flood[-1].headers["Retry-After"] == "60"
    assert "from this address" in flood[-1].json()["error"]
    # More addresses of the same /24: the prefix's share, then 503 for all of it.
    statuses = [
        (
            await check(sources, bridge, f"127.0.0.{host}", stranger_mac(100 + 10 * host + i), "c")
        ).status_code
        for host in range(3, 7)
        for i in range(4)
    ]
    assert statuses == [200] * 12 + [503] * 4
    assert store.pending_count == 16  # of 256: the rest is everybody else's
    # The victim on another network is not refused: a code, approved by that code, a token.
    first = await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)
    assert first.status_code == 200
    code = first.json()["activation"]["code"]
    assert await poll(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) == 202
    assert (await approve(bridge, code)).status_code == 200
    assert await poll(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) == 200
    answer = (await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)).json()
    assert answer["websocket"]["token"].startswith("dtk_")


async def test_a_full_table_makes_room_from_the_largest_prefix_never_from_the_newcomer(
    bridge_factory: Callable[..., Any], sources: Sources
) -> None:
    # 16 pending in all, one per address and per prefix: strangers on 16 networks fill it.
    # (The victim polls 20 times in a second here, not every 3 s: its poll budget is raised.)
    bridge: Bridge = await bridge_factory(
        device_auth="device",
        rate_limit_exempt=[],
        max_pending_activations=16,
        rate_limits={"activate_device": {"per_s": 1.0, "burst": 100}},
    )
    store = bridge.provisioning.store
    for net in range(16):
        answer = await check(sources, bridge, f"127.0.{10 + net}.2", stranger_mac(net), "c")
        assert answer.status_code == 200
    assert store.pending_count == 16
    # The victim on a 17th network still gets a code (the oldest stranger's request goes).
    first = await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)
    assert first.status_code == 200
    code = first.json()["activation"]["code"]
    # 20 more strangers, each from a network of its own, while the victim polls as stock
    # firmware does: every stranger gets in, and the victim's code stays.
    for net in range(16, 36):
        answer = await check(sources, bridge, f"127.0.{10 + net}.2", stranger_mac(net), "c")
        assert answer.status_code == 200
        assert await poll(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) == 202
    assert store.pending_count == 16
    again = await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)
    assert again.json()["activation"]["code"] == code
    assert (await approve(bridge, code)).status_code == 200


# ---- a Device-Id is never reserved by a stranger -------------------------------------------------


async def test_a_stranger_with_the_devices_mac_cannot_block_its_activation(
    bridge_factory: Callable[..., Any], sources: Sources
) -> None:
    # (The victim polls 20 times in a second here, not every 3 s: its poll budget is raised.)
    bridge: Bridge = await bridge_factory(
        device_auth="device",
        rate_limit_exempt=[],
        rate_limits={"activate_device": {"per_s": 1.0, "burst": 100}},
    )
    store = bridge.provisioning.store
    # The MAC is visible over Wi-Fi: a stranger claims it with 20 Client-Ids of its own (the
    # old bridge refused the real device for a day after 4 of them).
    strangers = [str(uuid.uuid4()) for _ in range(20)]
    for client_id in strangers:
        assert (await check(sources, bridge, "127.0.0.2", VICTIM, client_id)).status_code == 200
    assert len(store.candidates(VICTIM)) == MAX_PENDING_PER_DEVICE
    # The real device boots: it gets a code of its own.
    first = await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)
    assert first.status_code == 200
    code = first.json()["activation"]["code"]
    # The stranger goes on; the device polls as stock firmware does. Its candidate stays: the
    # stranger's prefix holds the most, so its own requests make the room.
    for client_id in [str(uuid.uuid4()) for _ in range(20)]:
        assert (await check(sources, bridge, "127.0.0.2", VICTIM, client_id)).status_code == 200
        assert await poll(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) == 202
    claims = store.candidates(VICTIM)
    assert len(claims) == MAX_PENDING_PER_DEVICE
    assert [c.client_id for c in claims if c.remote == VICTIM_ADDRESS] == [VICTIM_CLIENT]
    assert (await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)).json()[
        "activation"
    ]["code"] == code

    # The operator cannot approve by MAC: which candidate is the device only the code tells.
    ambiguous = await approve(bridge, VICTIM)
    error = ambiguous.json()["error"]
    assert ambiguous.status_code == 409 and error["code"] == "ambiguous_activation"
    assert "approve by code" in error["message"] and VICTIM_ADDRESS in error["message"]
    server = ["--server", bridge.api_url, "--token", ADMIN_TOKEN]
    status, out, err = await run_cli("devices", "pending", *server)
    assert status == 0, err
    assert code in out and f"1 of {MAX_PENDING_PER_DEVICE}" in out
    assert f"{VICTIM}: {MAX_PENDING_PER_DEVICE} candidates" in out
    status, _out, err = await run_cli("devices", "approve", VICTIM, *server)
    assert status == 1 and "approve by code" in err
    status, out, err = await run_cli("devices", "approve", code, *server)
    assert status == 0 and f"approved {VICTIM} (client {VICTIM_CLIENT})" in out, err

    # The device gets its token; the stranger's candidates went with the approval, and a
    # stranger asking again gets a code of its own, never the token.
    token = (await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)).json()[
        "websocket"
    ]["token"]
    stranger = (await check(sources, bridge, "127.0.0.2", VICTIM, strangers[0])).json()
    assert "activation" in stranger and token not in str(stranger)
    assert [c.client_id for c in store.candidates(VICTIM)] == [strangers[0]]


# ---- per-device budgets are the device's own -----------------------------------------------------


async def test_a_stranger_cannot_spend_an_approved_devices_ota_and_activation_budget(
    bridge_factory: Callable[..., Any], sources: Sources
) -> None:
    # Default budgets (1/s, burst 10 per device) on a clock that never moves: whatever the
    # stranger spends would come straight out of the device's 10.
    clock = ManualClock()
    bridge: Bridge = await bridge_factory(clock=clock, device_auth="device", rate_limit_exempt=[])
    code = (await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT)).json()[
        "activation"
    ]["code"]
    assert (await approve(bridge, code)).status_code == 200
    clock.advance(60.0)  # the budgets are full again
    # The stranger: 14 OTA checks and 14 activation polls with the device's MAC, with a
    # Client-Id of its own, and 14 checks with a new Client-Id each.
    other = str(uuid.uuid4())
    spent = [
        (await check(sources, bridge, "127.0.0.2", VICTIM, other)).status_code for _ in "x" * 14
    ]
    assert spent == [200] * 10 + [429] * 4  # the stranger's own budget
    polls = [await poll(sources, bridge, "127.0.0.2", VICTIM, other) for _ in "x" * 14]
    assert polls == [202] * 10 + [429] * 4
    for _ in range(14):
        fresh = str(uuid.uuid4())
        assert (await check(sources, bridge, "127.0.0.2", VICTIM, fresh)).status_code == 200
    # The device: all 10 checks of its burst answered with its credentials, its polls 200.
    answers = [
        await check(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) for _ in "x" * 10
    ]
    assert [a.status_code for a in answers] == [200] * 10
    assert all("websocket" in a.json() for a in answers)
    assert await poll(sources, bridge, VICTIM_ADDRESS, VICTIM, VICTIM_CLIENT) == 200
    refused = bridge.provisioning.limits.refused()
    assert (refused["ota_device"], refused["activate_device"]) == (4, 4)  # the stranger's only
