"""The device's MQTT link (reference §2.1) on micropython-lib's `umqtt.simple`, without blocking.

`umqtt.simple` builds and parses the MQTT packets (CONNECT with the last will and the login,
PUBLISH, SUBSCRIBE, PINGREQ, DISCONNECT, and incoming PUBLISH with its PUBACK). Its I/O is
blocking, which would stall the app loop (and, in the simulator, a thousand devices and an
embedded broker in the same event loop), so the bytes travel over asyncio streams instead:
umqtt reads and writes `_Wire`, an in-memory socket that this module fills with one complete
packet at a time and empties onto the stream. `connect()` reads the CONNACK (and SUBACK) itself.

Two behaviours (config `stock`):
- ours (default): a last will `offline` (retained) on the status topic, a retained `online`
  after connecting, its own subscription to the downlink topic; `offline` again on a clean close;
- stock firmware: client id `GID_…@@@<mac>@@@<uuid>`, no will, no subscription (the broker must
  subscribe it server-side: the embedded broker or EMQX's auto_subscribe), QoS 0, one topic.

Audio rides on UDP (`udp_audio`), opened by the server hello's `udp` block.
Same code on the ESP32, the unix port and CPython (the simulator).
"""

import asyncio

from compat import const, ticks_diff, ticks_ms

DEFAULT_PREFIX = "xiaozhi"
MAX_PACKET = const(262144)  # 256 KiB: far above any bridge message (tools/call, hello)
_PUBLISH = const(0x30)
_SUBACK = const(0x90)
_PINGRESP = const(0xD0)


class _WouldBlock(Exception):
    """umqtt asked for bytes that have not arrived: the caller reads them asynchronously."""


class _Wire:
    """The socket umqtt sees: reads from `rx` (one packet), writes collect in `tx`."""

    def __init__(self):
        self.rx = b""
        self.tx = []

    def write(self, data, length=None):
        if isinstance(data, str):
            data = data.encode()
        chunk = bytes(data if length is None else data[:length])  # umqtt reuses its buffers
        self.tx.append(chunk)
        return len(chunk)

    def read(self, count):
        if len(self.rx) < count:
            raise _WouldBlock()
        chunk, self.rx = self.rx[:count], self.rx[count:]
        return chunk

    def take(self) -> bytes:
        data = b"".join(self.tx)
        self.tx = []
        return data

    def setblocking(self, flag):
        pass

    def settimeout(self, value):
        pass

    def connect(self, address):
        pass

    def close(self):
        pass


class _Sockets:
    """Stands in for umqtt.simple's `socket` module: its connect() gets the prepared _Wire."""

    def __init__(self):
        self.wire = _Wire()

    def socket(self, *args):
        return self.wire

    def getaddrinfo(self, host, port, *args):
        return [(0, 0, 0, "", (host, port))]


_SOCKETS = _Sockets()
_UMQTT = []


def _umqtt():
    """umqtt.simple, imported on first use (config checks need no micropython-lib), with its
    `socket` module replaced: only connect() uses it, synchronously."""
    if not _UMQTT:
        import umqtt.simple as umqtt  # compat (imported above) aliases usocket etc. on CPython

        setattr(umqtt, "socket", _SOCKETS)
        _UMQTT.append(umqtt)
    return _UMQTT[0]


def umqtt_installed() -> bool:
    """Whether micropython-lib's umqtt.simple can be imported (a board needs it in /lib)."""
    try:
        _umqtt()
    except ImportError:
        return False
    return True


def parse_url(url):
    """(host, port, tls) of mqtt://host[:port] (1883) or mqtts://host[:port] (8883)."""
    if not isinstance(url, str) or "://" not in url:
        raise ValueError("MQTT URL must look like mqtt://host:port")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in ("mqtt", "mqtts"):
        raise ValueError("MQTT URL must start with mqtt:// or mqtts://: " + url)
    rest = rest.split("/", 1)[0]
    if "@" in rest or "[" in rest:
        raise ValueError("put the login in mqtt.username/password, not in the URL")
    tls = scheme == "mqtts"
    host, port = rest, 8883 if tls else 1883
    if ":" in rest:
        host, digits = rest.rsplit(":", 1)
        if not digits.isdigit() or not 0 < int(digits) < 65536:
            raise ValueError("bad port in MQTT URL: " + url)
        port = int(digits)
    if not host:
        raise ValueError("MQTT URL has no host: " + url)
    return host, port, tls


def device_key(device_id) -> str:
    """The topic level of a device id: a MAC in lower case with '_' for ':'."""
    return device_id.lower().replace(":", "_") if ":" in device_id else device_id


def topics(config, device_id):
    """(publish, subscribe, status) topics: explicit ones, else <prefix>/<device key>/…"""
    prefix = config.get("topic_prefix") or DEFAULT_PREFIX
    key = device_key(device_id)
    return (
        config.get("publish_topic") or prefix + "/" + key + "/up",
        config.get("subscribe_topic") or prefix + "/" + key + "/down",
        config.get("status_topic") or prefix + "/" + key + "/status",
    )


class MqttTransport:
    """One MQTT connection with the WsTransport interface the app uses, plus UDP audio."""

    persistent = True  # stays up while idle: MCP is served before and without any hello

    def __init__(self, config, device_id, client_id, timeout_s=10, log=print):
        self.host, self.port, self.tls = parse_url(config["url"])
        self.stock = bool(config.get("stock"))
        self.username = config.get("username")
        self.password = config.get("password") or ""
        self.client_id = config.get("client_id") or (
            "GID_xiaozhi@@@" + device_key(device_id) + "@@@" + client_id
            if self.stock
            else device_key(device_id)
        )
        self.keepalive = int(config.get("keepalive") or (240 if self.stock else 60))
        self.up, self.down, self.status = topics(config, device_id)
        self.timeout_s = timeout_s
        self.log = log
        self.close_code = None
        self.on_audio = None  # callback(payload) for downlink audio
        self.audio = None  # the UdpAudio of the open conversation
        self._client = None
        self._wire = _Wire()
        self._reader = None
        self._writer = None
        self._lock = asyncio.Lock()
        self._inbox = []
        self._suback = None
        self._open = False
        self._pinger = None
        self._last_rx = ticks_ms()

    @property
    def is_open(self) -> bool:
        return self._open

    # ---- connection ---------------------------------------------------------------------------

    async def connect(self):
        """TCP (TLS for mqtts), CONNECT, CONNACK; then (ours) subscribe and publish `online`."""
        try:
            await asyncio.wait_for(self._connect(), self.timeout_s)
        except asyncio.TimeoutError:
            await self._drop()
            raise OSError("MQTT connect to " + self.host + ":" + str(self.port) + " timed out")
        except BaseException:
            await self._drop()
            raise
        self._open = True
        self._last_rx = ticks_ms()
        if self.keepalive:
            self._pinger = asyncio.create_task(self._keep_alive())

    async def _connect(self):
        if self.tls:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, ssl=True
            )
        else:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        user = self.username.encode() if self.username else None
        client = _umqtt().MQTTClient(
            self.client_id.encode(), self.host, self.port, user, self.password.encode(),
            self.keepalive,
        )  # fmt: skip
        client.set_callback(self._on_message)
        if not self.stock:
            client.set_last_will(self.status.encode(), b"offline", True, 1)
        self._client = client
        _SOCKETS.wire = self._wire
        try:
            self._call(client.connect)  # writes CONNECT, then wants the CONNACK: ours to read
        finally:
            _SOCKETS.wire = _Wire()
        client.sock = self._wire
        await self._flush()
        packet, first, body = await self._read_packet()
        if first != 0x20 or len(body) != 2:
            raise OSError("broker answered CONNECT with packet type " + str(first >> 4))
        if body[1] != 0:
            raise OSError("broker refused the login (CONNACK code " + str(body[1]) + ")")
        if self.stock:
            return
        self._suback = None
        self._call(client.subscribe, self.down.encode(), 1)
        await self._flush()
        while self._suback is None:
            await self._handle(await self._read_packet())
        if not self._suback or self._suback[0] == 0x80:
            raise OSError("broker refused the subscription to " + self.down)
        await self._publish(self.status, b"online", True, 1)

    def _mqtt(self):
        client = self._client
        if client is None:
            raise OSError("MQTT link is not connected")
        return client

    def _call(self, method, *args):
        try:
            method(*args)
        except _WouldBlock:  # the reply (CONNACK, SUBACK, PUBACK) comes through _handle
            pass

    async def close(self):
        """A clean end: `offline` (ours), DISCONNECT (so the broker sends no will), close."""
        if self._open:
            self._open = False
            self.close_audio()
            try:
                if not self.stock:
                    await self._publish(self.status, b"offline", True, 1)
                self._call(self._mqtt().disconnect)
                await self._flush()
            except Exception:  # the link may already be gone
                pass
        await self._drop()

    async def _drop(self):
        self._open = False
        self.close_audio()
        pinger, self._pinger = self._pinger, None
        if pinger is not None and pinger is not asyncio.current_task():
            pinger.cancel()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
                await writer.wait_closed()
            except Exception:
                pass

    # ---- sending -------------------------------------------------------------------------------

    async def send(self, message):
        """Publish one JSON message (str) on the uplink topic; OSError when the link is down."""
        if not self._open:
            raise OSError("MQTT link is not open")
        if not isinstance(message, str):
            raise ValueError("MQTT carries text only; audio goes over UDP")
        await self._publish(self.up, message.encode(), False, 0)

    async def _publish(self, topic, payload, retain, qos):
        self._call(self._mqtt().publish, topic.encode(), payload, retain, qos)
        await self._flush()

    async def _flush(self):
        async with self._lock:
            data = self._wire.take()
            writer = self._writer
            if not data:
                return
            if writer is None:
                raise OSError("MQTT link is closed")
            writer.write(data)
            await writer.drain()

    async def _keep_alive(self):
        interval = self.keepalive / 2
        try:
            while self._open:
                await asyncio.sleep(interval)
                if ticks_diff(ticks_ms(), self._last_rx) > self.keepalive * 1500:
                    self.log("mqtt: nothing from the broker for 1.5 x keepalive; dropping")
                    await self._drop()
                    return
                self._call(self._mqtt().ping)
                await self._flush()
        except OSError:
            await self._drop()

    # ---- receiving -----------------------------------------------------------------------------

    async def receive(self):
        """The next message from the bridge (str), or None once the link is closed."""
        while True:
            if self._inbox:
                return self._inbox.pop(0)
            if not self._open:
                return None
            try:
                await self._flush()  # a PUBACK still waiting goes out (with the reply, if any)
                await self._handle(await self._read_packet())
            except (EOFError, OSError, ValueError) as error:
                if self._open:
                    self.log("mqtt: link lost: " + (str(error) or type(error).__name__))
                await self._drop()
                return None

    async def _read_packet(self):
        reader = self._reader
        if reader is None:
            raise OSError("MQTT link is closed")
        head = await reader.readexactly(1)
        size = shift = 0
        length = b""
        while True:
            byte = await reader.readexactly(1)
            length += byte
            size |= (byte[0] & 0x7F) << shift
            if not byte[0] & 0x80:
                break
            shift += 7
            if shift > 21:
                raise ValueError("malformed MQTT remaining length")
        if size > MAX_PACKET:
            raise ValueError("MQTT packet of " + str(size) + " bytes is too large")
        body = await reader.readexactly(size) if size else b""
        self._last_rx = ticks_ms()
        return head + length + body, head[0], body

    async def _handle(self, packet):
        data, first, body = packet
        kind = first & 0xF0
        if kind == _PUBLISH or first == _PINGRESP:
            self._wire.rx = data
            try:
                self._mqtt().wait_msg()  # PUBLISH: the callback, then its PUBACK (QoS 1)
            except _WouldBlock:
                self.log("mqtt: truncated packet dropped")
            self._wire.rx = b""
            # The PUBACK waits for the next write: sent alone, it would make Nagle hold the
            # reply that follows until the broker's delayed ACK (~40 ms on Linux).
        elif kind == _SUBACK:
            self._suback = list(body[2:])

    def _on_message(self, topic, message):
        try:
            self._inbox.append(str(message, "utf-8"))
        except UnicodeError:
            self.log("mqtt: dropped a message that is not UTF-8")

    # ---- audio (UDP) ---------------------------------------------------------------------------

    def open_audio(self, block):
        """Open the conversation's UDP channel from the server hello's `udp` object."""
        from udp_audio import UdpAudio

        self.close_audio()
        audio = UdpAudio(block, self._on_audio, self.log)
        audio.open()
        self.audio = audio

    def close_audio(self):
        audio, self.audio = self.audio, None
        if audio is not None:
            audio.close()

    def send_audio(self, payload, timestamp=0) -> bool:
        audio = self.audio
        return audio is not None and audio.send(payload, timestamp)

    def _on_audio(self, payload):
        if self.on_audio is not None:
            self.on_audio(payload)
