"""The MQTT + UDP transport against real brokers: Mosquitto (its own process, password and ACL
files), with a recording LinkAcceptor in place of the core. The bridge's embedded endpoint,
which is not a broker, has its own tests (test_mqtt_endpoint.py)."""

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from structlog.testing import capture_logs

from backend.devices.conversation import ConversationHub
from backend.devices.gateway import DeviceGateway
from backend.devices.registry import DeviceRegistry
from backend.errors import MessageTooLarge
from backend.protocol.audio import AudioFrame
from backend.transports.admission import Admission
from backend.transports.base import DeviceLink
from backend.transports.errors import LinkClosed, MqttConfigError
from backend.transports.mqtt import (
    BROKER_LOST,
    SHUTDOWN,
    BrokerAddress,
    BrokerVouched,
    MqttTransport,
)
from testkit.mosquitto import Mosquitto, mosquitto_available
from testkit.settings import make_settings
from tests.mqtt_helpers import (
    DEVICE_A,
    DEVICE_B,
    ID_A,
    ID_B,
    PASSWORDS,
    SCHEME,
    BrokerUnderTest,
    MosquittoUnderTest,
    RecordingAcceptor,
    RecordingHandler,
    broker_of_kind,
    device,
    eventually,
    running_transport,
    transport_settings,
)
from tests.mqtt_wire import RawMqttClient

KINDS = [
    pytest.param(
        "mosquitto",
        marks=pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed"),
    ),
]


@pytest.fixture(params=KINDS)
async def broker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BrokerUnderTest]:
    async with broker_of_kind(request.param, tmp_path) as running:
        yield running


@pytest.fixture
async def mosquitto(tmp_path: Path) -> AsyncIterator[BrokerUnderTest]:
    if not mosquitto_available():
        pytest.skip("mosquitto not installed")
    async with broker_of_kind("mosquitto", tmp_path) as running:
        yield running


# ---- links, order, presence ---------------------------------------------------------------------


async def test_presence_opens_a_link_and_the_last_will_closes_it(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with running_transport(broker.bridge_url, acceptor) as transport:
        async with device(broker.port, DEVICE_A) as dev:
            await eventually(lambda: bool(acceptor.of(ID_A)), what="open_link")
            handler = acceptor.latest(ID_A)
            identity = handler.link.identity
            assert (identity.device_id, identity.transport, identity.protocol_version) == (
                ID_A,
                "mqtt",
                1,
            )
            assert handler.link.conversation_scoped is False
            messages = [json.dumps({"type": "mcp", "n": index}) for index in range(50)]
            for text in messages:
                await dev.publish(SCHEME.up(DEVICE_A), text)
            await eventually(lambda: len(handler.texts) == 50, what="50 uplink messages")
            assert handler.texts == messages
            assert handler.closed == []
        # `device` aborts the TCP connection: the broker publishes the last will.
        await eventually(lambda: bool(handler.closed), what="on_closed after the will")
        assert handler.closed == ["device offline"]
        assert transport.links() == {}
        assert len(acceptor.of(ID_A)) == 1


async def test_send_text_reaches_the_device_downlink(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with running_transport(broker.bridge_url, acceptor), device(broker.port, DEVICE_A) as dev:
        await eventually(lambda: bool(acceptor.of(ID_A)))
        link = acceptor.latest(ID_A).link
        for index in range(3):
            await link.send_text(json.dumps({"type": "mcp", "id": index}))
        received = [await dev.next_publish() for _ in range(3)]
        assert [json.loads(p.payload)["id"] for p in received] == [0, 1, 2]
        assert {p.topic for p in received} == {SCHEME.down(DEVICE_A)}
        assert {p.qos for p in received} == {1}


async def test_a_device_cannot_publish_as_another_or_read_its_downlink(
    broker: BrokerUnderTest,
) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(broker.bridge_url, acceptor) as transport,
        device(broker.port, DEVICE_A) as dev_a,
        device(broker.port, DEVICE_B) as dev_b,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A) and acceptor.of(ID_B)))
        handler_b = acceptor.latest(ID_B)
        # A tries B's topics, and wildcards; then a marker on its own uplink.
        await dev_a.publish(SCHEME.up(DEVICE_B), '{"type":"mcp","spoofed":true}', qos=1)
        await dev_a.publish(SCHEME.status(DEVICE_B), b"offline", qos=1, retain=True)
        # Mosquitto 2.0 grants the subscription and filters every message by the ACL's read
        # rule at delivery: nothing of B's may arrive.
        refused = [1]
        for pattern in (SCHEME.down(DEVICE_B), "xiaozhi/+/down", "#"):
            assert await dev_a.subscribe(pattern) == refused
        await dev_a.publish(SCHEME.up(DEVICE_A), '{"type":"mcp","marker":true}', qos=1)
        await eventually(lambda: bool(acceptor.latest(ID_A).texts), what="A's marker")
        assert handler_b.texts == [] and handler_b.closed == []

        await handler_b.link.send_text('{"type":"mcp","for":"b"}')
        await acceptor.latest(ID_A).link.send_text('{"type":"mcp","for":"a"}')
        got_b = await dev_b.next_publish()
        assert got_b.payload.startswith(b"{"), got_b
        assert json.loads(got_b.payload)["for"] == "b"
        # B's message was published first: had it leaked to A, it would be there before A's.
        seen_by_a = [await dev_a.next_publish()]
        while not dev_a.publishes.empty():
            seen_by_a.append(dev_a.publishes.get_nowait())
        assert {p.topic for p in seen_by_a} == {SCHEME.down(DEVICE_A)}
        assert json.loads(seen_by_a[0].payload)["for"] == "a"
        assert transport.links().keys() == {ID_A, ID_B}


async def test_a_message_claiming_another_device_id_is_dropped(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(broker.bridge_url, acceptor) as transport,
        device(broker.port, DEVICE_A) as dev,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A)))
        handler = acceptor.latest(ID_A)
        await dev.publish(SCHEME.up(DEVICE_A), json.dumps({"type": "hello", "device_id": ID_B}))
        await dev.publish(SCHEME.up(DEVICE_A), json.dumps({"type": "hello", "device_id": ID_A}))
        await eventually(lambda: bool(handler.texts))
        assert [json.loads(text)["device_id"] for text in handler.texts] == [ID_A]
        assert transport.counters["dropped_claims_other_device"] == 1
        assert acceptor.of(ID_B) == []


async def test_a_slow_device_does_not_hold_up_the_others(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    acceptor.gates[ID_A] = asyncio.Event()
    async with (
        running_transport(broker.bridge_url, acceptor, inbound_queue=4) as transport,
        device(broker.port, DEVICE_A) as dev_a,
        device(broker.port, DEVICE_B) as dev_b,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A) and acceptor.of(ID_B)))
        received = transport.counters["received"]
        for index in range(10):
            await dev_a.publish(SCHEME.up(DEVICE_A), f'{{"n":{index}}}')
        # All ten reached the transport: A's worker holds one, its queue is full, the rest
        # were dropped. B is served all the same.
        await eventually(lambda: transport.counters["received"] >= received + 10)
        await dev_b.publish(SCHEME.up(DEVICE_B), '{"n":"b"}')
        await eventually(lambda: acceptor.latest(ID_B).texts == ['{"n":"b"}'], what="B served")
        dropped = transport.counters.get("dropped_queue_full", 0)
        assert dropped >= 5  # at most 4 queued plus the one the worker holds
        acceptor.gates[ID_A].set()
        await eventually(lambda: len(acceptor.latest(ID_A).texts) == 10 - dropped)
        # The ones delivered are the first ones, in order.
        assert acceptor.latest(ID_A).texts == [f'{{"n":{i}}}' for i in range(10 - dropped)]


async def test_broker_restart_closes_links_and_they_come_back(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with running_transport(broker.bridge_url, acceptor) as transport:
        async with device(broker.port, DEVICE_A):
            await eventually(lambda: bool(acceptor.of(ID_A)))
            first = acceptor.latest(ID_A)
            await broker.crash()
            await eventually(lambda: bool(first.closed), what="links closed on broker loss")
            assert first.closed == [BROKER_LOST]
            with pytest.raises(LinkClosed):
                await first.link.send_text('{"type":"mcp"}')
            assert not transport.connected

            await broker.start()
            restarted = time.monotonic()
            # The device reconnects on its own schedule and republishes its presence.
            dev = RawMqttClient("127.0.0.1", broker.port)
            async with asyncio.timeout(10):
                while True:
                    try:
                        await dev.connect(
                            f"GID_test@@@{DEVICE_A}@@@0b1c2d3e-uuid",
                            DEVICE_A,
                            "password-of-device-a",
                            will=(SCHEME.status(DEVICE_A), b"offline", 1, True),
                        )
                        break
                    except OSError:
                        await asyncio.sleep(0.05)
            assert await dev.subscribe(SCHEME.down(DEVICE_A)) == [1]
            await dev.publish(SCHEME.status(DEVICE_A), b"online", qos=1, retain=True)
            await eventually(lambda: len(acceptor.of(ID_A)) == 2, 10, "link back after restart")
            assert time.monotonic() - restarted < 10
            await transport.wait_connected(1)
            second = acceptor.latest(ID_A)
            assert second.closed == []
            await second.link.send_text('{"type":"mcp","after":"restart"}')
            assert json.loads((await dev.next_publish()).payload)["after"] == "restart"
            await dev.abort()
        assert transport.counters["broker_losses"] == 1


async def test_stop_closes_every_link(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with running_transport(broker.bridge_url, acceptor), device(broker.port, DEVICE_A):
        await eventually(lambda: bool(acceptor.of(ID_A)))
    assert acceptor.latest(ID_A).closed == [SHUTDOWN]


async def test_link_close_forgets_the_device_until_it_speaks_again(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(broker.bridge_url, acceptor) as transport,
        device(broker.port, DEVICE_A) as dev,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A)))
        first = acceptor.latest(ID_A)
        await first.link.close(1008, "policy violation")
        assert first.closed == ["policy violation"]
        await first.link.close()  # idempotent: on_closed stays at one call
        assert first.closed == ["policy violation"]
        with pytest.raises(LinkClosed):
            await first.link.send_text("{}")
        assert transport.links() == {}
        await dev.publish(SCHEME.up(DEVICE_A), '{"type":"mcp","again":1}')
        await eventually(lambda: len(acceptor.of(ID_A)) == 2, what="a new link")
        await eventually(lambda: acceptor.latest(ID_A).texts == ['{"type":"mcp","again":1}'])


# ---- UDP through the transport ------------------------------------------------------------------


async def test_hello_fields_open_a_udp_session_that_carries_audio(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(broker.bridge_url, acceptor) as transport,
        device(broker.port, DEVICE_A),
    ):
        await eventually(lambda: bool(acceptor.of(ID_A)))
        handler = acceptor.latest(ID_A)
        fields = handler.link.hello_fields("session-1")
        assert fields["transport"] == "udp"
        udp = fields["udp"]
        assert isinstance(udp, dict)
        assert udp["server"] == "127.0.0.1" and udp["port"] == transport.udp.port
        key, nonce = bytes.fromhex(udp["key"]), bytes.fromhex(udp["nonce"])
        assert nonce[0] == 1 and len(key) == 16

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.connect(("127.0.0.1", udp["port"]))
        sock.setblocking(False)
        try:
            sock.send(_device_packet(key, nonce, b"mic", 1))
            await eventually(lambda: handler.audio == [AudioFrame(b"mic", 0)], what="uplink")
            await handler.link.send_audio(AudioFrame(b"speaker", 60))
            datagram = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 2048), 5)
            assert struct.unpack_from(">I", datagram, 12)[0] == 1  # downlink sequence starts at 1
            plain = Cipher(algorithms.AES(key), modes.CTR(datagram[:16])).decryptor()
            assert plain.update(datagram[16:]) == b"speaker"

            handler.link.conversation_ended("another-session")  # not this one: kept
            sock.send(_device_packet(key, nonce, b"mic2", 2))
            await eventually(lambda: len(handler.audio) == 2)
            handler.link.conversation_ended("session-1")
            sock.send(_device_packet(key, nonce, b"mic3", 3))
            await eventually(lambda: transport.udp.counters.get("drop_unknown_cookie") == 1)
            await handler.link.send_audio(AudioFrame(b"after the end"))  # nowhere to go
            assert transport.counters["udp_no_session"] == 1
            assert len(handler.audio) == 2
        finally:
            sock.close()


def _device_packet(key: bytes, nonce: bytes, payload: bytes, sequence: int) -> bytes:
    header = bytearray(nonce)
    header[2:4] = struct.pack(">H", len(payload))
    header[8:16] = struct.pack(">II", 0, sequence)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(header))).encryptor()
    return bytes(header) + encryptor.update(payload)


# ---- stock firmware: no subscription, no will ---------------------------------------------------


async def test_stock_device_gets_nothing_through_mosquitto(mosquitto: BrokerUnderTest) -> None:
    # What docs/mqtt.md states: Mosquitto cannot push to a client that never subscribed.
    acceptor = RecordingAcceptor()
    async with (
        running_transport(mosquitto.bridge_url, acceptor, silence_timeout_s=60),
        device(mosquitto.port, DEVICE_A, will=False, online=False, subscribe=False) as stock,
        device(mosquitto.port, DEVICE_B) as ours,
    ):
        await stock.publish(SCHEME.up(DEVICE_A), '{"type":"mcp","payload":{}}')
        await eventually(lambda: bool(acceptor.of(ID_A) and acceptor.of(ID_B)))
        await acceptor.latest(ID_A).link.send_text('{"type":"mcp","to":"stock"}')
        await acceptor.latest(ID_B).link.send_text('{"type":"mcp","to":"ours"}')
        assert json.loads((await ours.next_publish()).payload)["to"] == "ours"
        assert stock.publishes.empty()


async def test_a_stock_device_without_presence_times_out_on_silence(
    mosquitto: BrokerUnderTest,
) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(
            mosquitto.bridge_url, acceptor, silence_timeout_s=0.5, silence_check_s=0.05
        ) as transport,
        device(mosquitto.port, DEVICE_A, will=False, online=False, subscribe=False) as stock,
    ):
        await stock.publish(SCHEME.up(DEVICE_A), '{"type":"mcp","payload":{}}')
        await eventually(lambda: bool(acceptor.of(ID_A)), what="link from the first message")
        handler = acceptor.latest(ID_A)
        await eventually(lambda: bool(handler.closed), what="silence timeout")
        assert handler.closed == ["no message for 0.5 s"]
        assert transport.counters["silence_timeouts"] == 1


# ---- settings -----------------------------------------------------------------------------------


def test_broker_urls() -> None:
    plain = BrokerAddress.parse("mqtt://127.0.0.1")
    assert (plain.host, plain.port, plain.tls, plain.username) == ("127.0.0.1", 1883, False, None)
    secure = BrokerAddress.parse("mqtts://bridge:p%40ss%3Aword@broker.example:9999")
    assert (secure.port, secure.tls, secure.username, secure.password) == (
        9999,
        True,
        "bridge",
        "p@ss:word",
    )
    assert BrokerAddress.parse("mqtts://h").port == 8883
    assert "p@ss" not in repr(secure) and "p@ss" not in secure.redacted()
    assert secure.redacted() == "mqtts://bridge@broker.example:9999"
    for bad in ("http://h:1", "mqtt://", "mqtt://h:99999", "h:1883"):
        with pytest.raises(MqttConfigError):
            BrokerAddress.parse(bad)


def test_udp_public_host_is_required_when_binding_everywhere() -> None:
    settings = transport_settings("mqtt://127.0.0.1:1", udp_host="0.0.0.0")
    with pytest.raises(MqttConfigError):
        settings.announced_udp_host()
    assert (
        transport_settings(
            "mqtt://127.0.0.1:1", udp_host="0.0.0.0", udp_public_host="192.0.2.7"
        ).announced_udp_host()
        == "192.0.2.7"
    )
    assert "secret" not in repr(transport_settings("mqtt://u:secret@127.0.0.1:1"))


# ---- link lifecycle details ---------------------------------------------------------------------


class _RefuseB:
    def refusal(self, device_id: str, presented: str | None) -> str | None:
        return "not on the allow-list" if device_id == ID_B else None


async def test_admission_decides_who_gets_a_link(mosquitto: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    transport = MqttTransport(transport_settings(mosquitto.bridge_url), Admission(_RefuseB()))
    await transport.start(acceptor)
    try:
        await transport.wait_connected(10)
        async with device(mosquitto.port, DEVICE_A), device(mosquitto.port, DEVICE_B) as dev_b:
            await dev_b.publish(SCHEME.up(DEVICE_B), '{"type":"mcp"}')
            await eventually(lambda: bool(acceptor.of(ID_A)))
            await eventually(lambda: transport.counters.get("dropped_refused", 0) >= 2)
            assert acceptor.of(ID_B) == []
    finally:
        await transport.stop()


async def test_offline_hands_over_queued_messages_before_closing(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    acceptor.gates[ID_A] = asyncio.Event()
    async with running_transport(broker.bridge_url, acceptor) as transport:
        async with device(broker.port, DEVICE_A) as dev:
            await eventually(lambda: bool(acceptor.of(ID_A)))
            for index in range(3):
                await dev.publish(SCHEME.up(DEVICE_A), f'{{"n":{index}}}', qos=1)
            await dev.publish(SCHEME.up(DEVICE_A), '{"type":"goodbye"}', qos=1)
        handler = acceptor.latest(ID_A)
        # The will arrives while the session is still held on the first message.
        await eventually(lambda: transport.links() == {}, what="device forgotten on offline")
        assert handler.closed == [] and handler.texts == []
        acceptor.gates[ID_A].set()
        await eventually(lambda: handler.closed == ["device offline"], what="closed after drain")
        assert handler.texts == ['{"n":0}', '{"n":1}', '{"n":2}', '{"type":"goodbye"}']


class _ClosingHandler(RecordingHandler):
    async def on_text(self, text: str) -> None:
        await super().on_text(text)
        if text == '{"type":"close me"}':
            await self.link.close(1008, "closed from inside on_text")
            await asyncio.sleep(0)  # the session keeps running after close() returns


async def test_closing_a_link_from_inside_its_own_handler(mosquitto: BrokerUnderTest) -> None:
    handlers: list[_ClosingHandler] = []

    class Acceptor:
        def open_link(self, link: DeviceLink) -> _ClosingHandler:
            handlers.append(_ClosingHandler(link))
            return handlers[-1]

    async with (
        running_transport(mosquitto.bridge_url, Acceptor()) as transport,  # type: ignore[arg-type]
        device(mosquitto.port, DEVICE_A) as dev,
    ):
        await eventually(lambda: bool(handlers))
        await dev.publish(SCHEME.up(DEVICE_A), '{"type":"close me"}', qos=1)
        await eventually(lambda: bool(handlers[0].closed))
        assert handlers[0].closed == ["closed from inside on_text"]
        assert handlers[0].texts == ['{"type":"close me"}']
        assert transport.links() == {}
        await dev.publish(SCHEME.up(DEVICE_A), '{"type":"mcp"}', qos=1)
        await eventually(lambda: len(handlers) == 2 and handlers[1].texts == ['{"type":"mcp"}'])
        assert handlers[0].closed == ["closed from inside on_text"]
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("mqtt-device-")]
    assert tasks == []  # no worker left behind


async def test_late_messages_after_offline_do_not_reopen_a_link(
    mosquitto: BrokerUnderTest,
) -> None:
    # A broker may deliver a device's last messages after its presence event (amqtt, the
    # embedded broker before the bridge's own endpoint, did).
    # Mosquitto delivers in order (and acknowledges a QoS 1 publish after routing it), so the
    # devices can stage exactly that order.
    acceptor = RecordingAcceptor()
    assert isinstance(mosquitto, MosquittoUnderTest)
    async with (
        running_transport(mosquitto.bridge_url, acceptor) as transport,
        device(mosquitto.port, DEVICE_A) as dev_a,
        device(mosquitto.port, DEVICE_B) as dev_b,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A) and acceptor.of(ID_B)))
        await dev_a.publish(SCHEME.status(DEVICE_A), b"offline", qos=1)
        await dev_a.publish(SCHEME.up(DEVICE_A), b'{"type":"mcp","late":true}', qos=1)
        await dev_b.publish(SCHEME.up(DEVICE_B), b'{"type":"mcp","marker":true}', qos=1)
        await eventually(lambda: bool(acceptor.latest(ID_B).texts), what="the marker")
        assert acceptor.latest(ID_A).closed == ["device offline"]
        assert len(acceptor.of(ID_A)) == 1
        assert transport.counters["dropped_after_offline"] == 1
        # A new `online` lifts it at once.
        await dev_a.publish(SCHEME.status(DEVICE_A), b"online", qos=1)
        await eventually(lambda: len(acceptor.of(ID_A)) == 2)


# ---- TLS ----------------------------------------------------------------------------------------


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1, made here with `cryptography`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bridge test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (directory / "ca.pem", directory / "server.pem", directory / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


async def test_mqtts_to_a_tls_mosquitto(tmp_path: Path) -> None:
    if not mosquitto_available():
        pytest.skip("mosquitto not installed")
    ca, cert, key = _tls_files(tmp_path)
    broker = Mosquitto(tmp_path / "broker", PASSWORDS)
    with broker.conf.open("a") as conf:
        conf.write(f"certfile {cert}\nkeyfile {key}\ncafile {ca}\n")
    await broker.start()
    try:
        acceptor = RecordingAcceptor()
        bridge = broker.bridge
        url = f"mqtts://{bridge.username}:{bridge.password}@127.0.0.1:{broker.port}"
        async with running_transport(url, acceptor, tls_ca_file=str(ca)) as transport:
            assert transport.endpoints()["mqtt"] == f"mqtts://bridge@127.0.0.1:{broker.port}"
            # The test device client speaks plain TCP only: the bridge's own publish, coming
            # back through its subscription, proves the TLS channel both ways.
            await transport.publish(SCHEME.status(DEVICE_A), "online")
            await eventually(lambda: bool(acceptor.of(ID_A)), what="own publish seen over TLS")
        # Without the CA the server certificate is refused.
        untrusting = MqttTransport(transport_settings(url), Admission(BrokerVouched()))
        await untrusting.start(RecordingAcceptor())
        try:
            await eventually(
                lambda: untrusting.counters.get("broker_connect_failures", 0) >= 1,
                what="a refused TLS handshake",
            )
            assert not untrusting.connected
        finally:
            await untrusting.stop()
    finally:
        await broker.stop()


def test_broker_url_round_trips_ipv6_and_odd_passwords() -> None:
    address = BrokerAddress.parse("mqtt://bridge:p%40ss%3Aw%2Frd@[::1]:1884")
    assert (address.host, address.port, address.password) == ("::1", 1884, "p@ss:w/rd")
    assert address.redacted() == "mqtt://bridge@[::1]:1884"


# ---- per-device bounds: the outbound frame cap, every inbound message charged -------------------


async def test_a_text_over_the_device_limit_is_not_published(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    async with (
        running_transport(broker.bridge_url, acceptor, max_message_bytes=1024),
        device(broker.port, DEVICE_A) as dev,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A)))
        link = acceptor.latest(ID_A).link
        with pytest.raises(MessageTooLarge) as too_large:
            await link.send_text(json.dumps({"type": "stt", "text": "x" * 2000}))
        assert too_large.value.limit == 1024
        # The limit is in UTF-8 bytes: 600 characters of 3 bytes each are over it as well.
        with pytest.raises(MessageTooLarge):
            await link.send_text(json.dumps({"text": "€" * 600}, ensure_ascii=False))
        empty = json.dumps({"type": "stt", "text": ""})
        at_limit = json.dumps({"type": "stt", "text": "y" * (1024 - len(empty))})
        assert len(at_limit.encode()) == 1024
        await link.send_text(at_limit)
        await link.send_text('{"type":"mcp","after":true}')
        # Neither big one went out: the first publish the device sees is the one at the limit.
        first, second = await dev.next_publish(), await dev.next_publish()
        assert (first.payload, second.payload) == (
            at_limit.encode(),
            b'{"type":"mcp","after":true}',
        )
        # The link is fine after a refusal.
        assert acceptor.latest(ID_A).closed == []


async def test_uplinks_dropped_by_the_transport_are_still_charged(broker: BrokerUnderTest) -> None:
    acceptor = RecordingAcceptor()
    acceptor.gates[ID_A] = asyncio.Event()  # the session is busy: its queue fills up
    async with (
        running_transport(broker.bridge_url, acceptor, inbound_queue=2) as transport,
        device(broker.port, DEVICE_A) as dev,
    ):
        await eventually(lambda: bool(acceptor.of(ID_A)))
        handler = acceptor.latest(ID_A)
        not_utf8 = b"\xff\xfe" * 50
        claims_b = json.dumps({"type": "hello", "device_id": ID_B})

        def uplinks() -> list[int]:
            # A repeated `online` is charged as well, and left out here.
            return [size for size in handler.discarded if size != len(b"online")]

        await dev.publish(SCHEME.up(DEVICE_A), not_utf8, qos=1)
        await dev.publish(SCHEME.up(DEVICE_A), claims_b, qos=1)
        await eventually(lambda: len(uplinks()) == 2, what="both charged")
        assert uplinks() == [len(not_utf8), len(claims_b)]
        for index in range(10):  # one held by the worker, two queued, the rest dropped
            await dev.publish(SCHEME.up(DEVICE_A), f'{{"n":{index}}}', qos=1)
        await eventually(lambda: transport.counters.get("dropped_queue_full", 0) >= 7)
        dropped = transport.counters["dropped_queue_full"]
        assert uplinks()[2:] == [len('{"n":0}')] * dropped
        acceptor.gates[ID_A].set()
        await eventually(lambda: len(handler.texts) == 10 - dropped)
        # Delivered ones are charged by the session itself (`on_text`), never twice.
        assert len(uplinks()) == 2 + dropped


class _Penalties:
    """The bridge's handshake limits, reduced to the cut-off penalty (`Admission.cut_off`)."""

    def __init__(self) -> None:
        self.penalized: list[str] = []

    def ip_refusal(self, remote: str | None) -> str | None:
        return None

    def device_refusal(self, device_id: str) -> str | None:
        return "cut off a moment ago" if device_id in self.penalized else None

    def penalize(self, device_id: str) -> None:
        self.penalized.append(device_id)


async def test_a_device_flooding_junk_over_mqtt_is_cut_off(
    mosquitto: BrokerUnderTest, tmp_path: Path
) -> None:
    """The real session behind the transport: non-UTF-8 junk, which never reaches `on_text`,
    empties the device's inbound limit and its link is closed (and held off); another device
    keeps its link."""
    settings = make_settings(tmp_path / "data", max_inbound_messages_per_s=20.0)  # 40 at once
    registry = DeviceRegistry()
    gateway = DeviceGateway(registry, ConversationHub(registry), settings)
    penalties = _Penalties()
    transport = MqttTransport(
        transport_settings(mosquitto.bridge_url), Admission(BrokerVouched(), penalties)
    )
    with capture_logs() as logs:
        await transport.start(gateway)
        try:
            await transport.wait_connected(10)
            async with (
                device(mosquitto.port, DEVICE_A) as attacker,
                device(mosquitto.port, DEVICE_B),
            ):
                await eventually(lambda: transport.links().keys() == {ID_A, ID_B})
                for _ in range(200):
                    await attacker.publish(SCHEME.up(DEVICE_A), b"\xff" * 100)
                await eventually(lambda: ID_A not in transport.links(), what="attacker cut off")
                await eventually(lambda: transport.counters.get("received", 0) >= 200 + 2)
                assert ID_B in transport.links()
                assert registry.get(ID_A) is None and registry.get(ID_B) is not None
        finally:
            await transport.stop()
    assert penalties.penalized == [ID_A]
    mine = [entry for entry in logs if entry.get("device_id") == ID_A]
    cut = [entry for entry in mine if entry["event"] == "device cut off"]
    assert len(cut) == 1 and cut[0]["reason"] == "inbound rate limit exceeded", mine
    assert transport.counters["links_opened"] == 2  # the attacker's link was not reopened
    # The burst was charged on the link, the rest refused without one: all 200 in a few lines.
    charged, refused = transport.counters["dropped_not_utf8"], transport.counters["dropped_refused"]
    assert charged + refused == 200, transport.counters
    assert len(logs) < 40, [entry["event"] for entry in logs]


async def test_a_retained_uplink_is_never_replayed_to_the_bridge(
    mosquitto: BrokerUnderTest,
) -> None:
    """Mosquitto keeps retained messages (our firmware needs a retained will): one left on a
    device's uplink must not be taken as a request each time the bridge subscribes again."""
    acceptor = RecordingAcceptor()
    async with device(mosquitto.port, DEVICE_A) as dev:
        await dev.publish(SCHEME.up(DEVICE_A), '{"type":"listen","text":"old"}', qos=1, retain=True)
        async with running_transport(mosquitto.bridge_url, acceptor) as transport:
            await eventually(
                lambda: transport.counters.get("dropped_retained_uplink", 0) == 1,
                what="the retained uplink dropped",
            )
            await dev.publish(SCHEME.up(DEVICE_A), '{"type":"listen","text":"new"}', qos=1)
            await eventually(lambda: bool(acceptor.of(ID_A)) and acceptor.latest(ID_A).texts != [])
            assert acceptor.latest(ID_A).texts == ['{"type":"listen","text":"new"}']
