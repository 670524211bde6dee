"""The front ends of the chat pipeline, wired into the bridge in one place.

`FrontEnds` owns the conversation memory, the `ChatService`, the API key store, the `/mcp`
endpoint, the device conversations and their voice (with each device's voice language), on the
bridge's database, registry and conversation hub; `routers()` and `routes()` go into the HTTP
app; `start()` after the database is open, `stop()` before it closes.
"""

from fastapi import APIRouter
from starlette.routing import BaseRoute

from backend.api.chat import allowed_models, chat_router
from backend.api.keys import keys_router
from backend.api.mcp_endpoint import McpEndpoint
from backend.api.responses import responses_router
from backend.api.voice import voice_router
from backend.chat import CHAT_MIGRATIONS, ChatService, SqliteMemoryStore
from backend.config import Settings
from backend.devices import DeviceRegistry
from backend.devices.conversation import ConversationHub
from backend.dialogue.device_chat import DeviceChat
from backend.frontends.voice import build_voice
from backend.keys import KEYS_MIGRATIONS, KeyStore
from backend.mcp_servers.hub import McpServerHub
from backend.storage import Database, Migration
from backend.voice.language import (
    VOICE_MIGRATIONS,
    VoiceLanguages,
    available_languages,
    effective_language,
)

FRONTEND_MIGRATIONS: tuple[Migration, ...] = (
    *CHAT_MIGRATIONS,
    *KEYS_MIGRATIONS,
    *VOICE_MIGRATIONS,
)


class FrontEnds:
    """What users talk to the bridge through: the chat, API keys, the MCP endpoint, the device
    chat."""

    def __init__(
        self,
        settings: Settings,
        database: Database,
        registry: DeviceRegistry,
        hub: ConversationHub,
        servers: McpServerHub | None = None,
    ) -> None:
        self.memory = SqliteMemoryStore(database)
        self.chat = ChatService.from_settings(settings, self.memory)
        self.keys = KeyStore(database)
        self.mcp = McpEndpoint(registry, self.chat, host=settings.http_host, servers=servers)
        self.device_chat = DeviceChat(hub, registry, self.chat, servers)
        self.languages = VoiceLanguages(database)
        self.voice = build_voice(
            settings, hub, registry, self.device_chat, languages=self.languages.language
        )
        self.languages_available = available_languages(settings)
        self._settings = settings
        self._registry = registry
        self._servers = servers
        self._allowed_models = allowed_models(settings)
        self._started = False

    def routers(self) -> list[APIRouter]:
        """The API routers of the front ends (keys, chat, responses, devices' voice languages)."""
        chat = chat_router(self.chat, self._registry, self._servers, self._allowed_models)
        responses = responses_router(self.chat, self._registry, self._servers, self._allowed_models)
        voice = voice_router(
            self.languages, self._registry, self.heard_in, self.languages_available
        )
        return [keys_router(self.keys), chat, responses, voice]

    def heard_in(self, device_id: str) -> str:
        """The language the device's next utterance is heard in (English where the bridge
        cannot hear its language)."""
        language = effective_language(
            self.languages.language(device_id),
            self._settings.asr_language,
            self.device_chat.language_of(device_id),
        )
        return language if language in self.languages_available else "en"

    def routes(self) -> list[BaseRoute]:
        """The raw routes of the front ends (the MCP endpoint's WebSocket)."""
        return [self.mcp.route]

    async def start(self) -> None:
        """Needs the open database: loads the key index, starts `/mcp` sessions and device
        conversations."""
        self._started = True
        await self.keys.load()
        await self.languages.load()
        self.languages.follow(self._registry)
        await self.mcp.start()
        self.device_chat.start()
        await self.voice.start()

    async def stop_sessions(self) -> None:
        """Cancel device turns and end `/mcp` sessions (before the HTTP server drains)."""
        if not self._started:
            return
        await self.voice.stop()
        await self.device_chat.stop()
        await self.mcp.stop()

    async def close(self) -> None:
        """Write what is left (key last-use times) and close the model client."""
        if self._started:
            await self.keys.aclose()
            await self.languages.aclose()
        await self.chat.aclose()
