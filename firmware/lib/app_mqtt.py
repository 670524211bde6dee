"""The app loop over a persistent link (MQTT + UDP, reference §2), as the stock firmware runs it.

Unlike WebSocket, the link is up while the device is idle: MCP requests are served from the
moment it connects, without any hello. A conversation is opened on demand: the device sends a
hello (`transport: "udp"`, version 3), the server answers with the session id and the UDP
block, audio then flows over UDP. `goodbye` ends it from either side; the server's goodbye
counts only with the current session id (stock ≥ 2.2.6). A later hello replaces the session.
"""

import asyncio

import protocol
from app import HELLO_TIMEOUT_S, App

MQTT_HELLO_VERSION = 3


class MqttApp(App):
    def __init__(self, config, hal, server, transport_factory, log=print):
        super().__init__(config, hal, server, transport_factory, log)
        self.audio_received = 0
        self.on_audio = None  # callback(payload) for downlink audio (decrypted)
        self.conversations = 0

    @property
    def in_conversation(self) -> bool:
        return self.ready_event.is_set()

    async def _open_session(self, transport) -> bool:
        transport.on_audio = self._on_audio
        self.session_id = ""
        self.log("link: connected; serving MCP (no hello until a conversation starts)")
        return True

    async def _dispatch(self, transport, message):
        if isinstance(message, str) and ('"hello"' in message or '"goodbye"' in message):
            msg = protocol.parse(message)
            kind = msg.get("type") if msg is not None else None
            if kind == "hello":
                self._on_server_hello(transport, msg)
                return
            if kind == "goodbye":
                self._on_server_goodbye(transport, msg)
                return
        await super()._dispatch(transport, message)

    def _on_server_hello(self, transport, msg):
        if not protocol.is_server_hello(msg, "udp"):
            self._ignore("server hello without transport udp", protocol.encode(msg))
            return
        try:
            transport.open_audio(msg.get("udp"))
        except (ValueError, OSError) as error:  # stock ignores such a hello (and times out)
            self.log("link: server hello ignored: " + str(error))
            return
        session_id = msg.get("session_id")
        self.session_id = session_id if isinstance(session_id, str) else ""
        self.conversations += 1
        self.ready_event.set()
        self.log("link: conversation " + self.session_id + " open (udp audio)")

    def _on_server_goodbye(self, transport, msg):
        session_id = msg.get("session_id")
        if not self.ready_event.is_set() or session_id != self.session_id:
            self.log("link: goodbye for another session ignored: " + repr(session_id))
            return
        self._conversation_over(transport)
        self.log("link: conversation ended by the server")

    def _conversation_over(self, transport):
        self.ready_event.clear()
        if transport is not None:
            transport.close_audio()

    def _on_audio(self, payload):
        self.audio_received += 1
        if self.on_audio is not None:
            self.on_audio(payload)

    # ---- conversation, for the console and the simulator -------------------------------------

    async def open_conversation(self) -> bool:
        """Say hello and wait for the server's (with its UDP block); False if none came."""
        if self.ready_event.is_set():
            return True
        transport = self._transport
        if transport is None or not self.connected:
            self.log("link: not connected; no conversation")
            return False
        self.session_id = ""
        try:
            await transport.send(protocol.device_hello(MQTT_HELLO_VERSION, "udp"))
            await asyncio.wait_for(_wait(self.ready_event), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.log("link: no server hello within " + str(HELLO_TIMEOUT_S) + " s")
            return False
        except OSError as error:
            self.log("link: hello not sent: " + str(error))
            return False
        return True

    async def send_text(self, text) -> bool:
        if not await self.open_conversation():
            return False
        return await super().send_text(text)

    def send_audio(self, payload, timestamp=0) -> bool:
        """One uplink audio packet over UDP; False outside a conversation."""
        transport = self._transport
        if transport is None or not self.ready_event.is_set():
            return False
        return transport.send_audio(payload, timestamp)

    async def goodbye(self) -> bool:
        """End the conversation from the device: close UDP, then publish goodbye."""
        transport = self._transport
        if transport is None or not self.ready_event.is_set():
            return False
        self._conversation_over(transport)
        try:
            await transport.send(protocol.goodbye(self.session_id))
        except OSError as error:
            self.log("link: goodbye not sent: " + str(error))
            return False
        return True


async def _wait(event):
    await event.wait()
