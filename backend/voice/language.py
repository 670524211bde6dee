"""Each device's voice language: "auto", "en" or "vi", kept in the bridge database.

The setting says which recognizer hears the device (`RecognitionHints.language`): "en" is
Whisper, "vi" the Vietnamese recognizer (the `voice-vi` extra), "auto" (the default, never
stored) lets `effective_language` decide: the bridge's `asr_language` when set, else the
language of the device's last turn, else English.

The utterance path never waits on the database: `language(device_id)` reads an in-memory copy.
`load()` reads the table at start; on a database other bridges share (PostgreSQL) the copy is
read again every `refresh_s` (2 s), so a change made through another instance is heard within
that. A device forgotten from the catalogue loses its setting.
"""

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal, get_args

import structlog

from backend.errors import BridgeError
from backend.storage import Database, Migration

if TYPE_CHECKING:
    from backend.config import Settings
    from backend.devices import DeviceRegistry
    from backend.devices.state import DeviceEvent

log = structlog.get_logger("voice.language")

VoiceLanguage = Literal["auto", "en", "vi"]
VOICE_LANGUAGES: tuple[VoiceLanguage, ...] = get_args(VoiceLanguage)
LANGUAGE_REFRESH_S = 2.0  # on a shared database: how stale another instance's change may be

VOICE_MIGRATIONS = (
    Migration(
        "voice",
        1,
        """
        CREATE TABLE device_voice (
            device_id TEXT PRIMARY KEY,
            language TEXT NOT NULL,
            updated_at TEXT NOT NULL
        );
        """,
    ),
)

_UPSERT = """
INSERT INTO device_voice (device_id, language, updated_at) VALUES (?, ?, ?)
ON CONFLICT (device_id) DO UPDATE SET language = excluded.language, updated_at = excluded.updated_at
"""


def effective_language(device: str | None, bridge: str | None, last_turn: str | None) -> str:
    """The language a device is heard in: its own setting (None for "auto"), else the bridge's
    `asr_language`, else its last turn's language, else English."""
    return device or bridge or last_turn or "en"


def available_languages(settings: "Settings") -> tuple[str, ...]:
    """The languages this bridge's recognition can hear ("vi" needs the `voice-vi` extra, or a
    transcription server, which is told the language)."""
    from backend.voice.recognition.select import vietnamese_installed

    if settings.asr_provider == "openai":
        return ("en", "vi")
    if settings.asr_vietnamese and vietnamese_installed():
        return ("en", "vi")
    return ("en",)


class VoiceLanguages:
    """The per-device voice language settings: the `device_voice` table and its in-memory copy.
    Open the database with VOICE_MIGRATIONS."""

    def __init__(self, db: Database, *, refresh_s: float | None = None) -> None:
        """`refresh_s`: how often the copy is read again; by default LANGUAGE_REFRESH_S on a
        shared database (PostgreSQL) and never on the bridge's own SQLite file."""
        self.db = db
        self.refresh_s = (
            refresh_s if refresh_s is not None else LANGUAGE_REFRESH_S if db.shared else None
        )
        self._settings: dict[str, VoiceLanguage] = {}
        self._lock = asyncio.Lock()  # a reload never undoes a change written while it read
        self._refresher: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._unsubscribe: list[Callable[[], None]] = []

    def setting(self, device_id: str) -> VoiceLanguage:
        """The device's setting ("auto" when it has none), from memory."""
        return self._settings.get(device_id, "auto")

    def language(self, device_id: str) -> str | None:
        """The language the device is set to, None for "auto" (`VoiceService.languages`)."""
        chosen = self._settings.get(device_id)
        return None if chosen in (None, "auto") else chosen

    async def load(self) -> None:
        """Read every setting into memory (and, on a shared database, again every
        `refresh_s`)."""
        async with self._lock:
            rows = await self.db.fetchall("SELECT device_id, language FROM device_voice")
            self._settings = {
                row["device_id"]: row["language"]
                for row in rows
                if row["language"] in VOICE_LANGUAGES
            }
        if self.refresh_s is not None and self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_forever(self.refresh_s), name="voice-language-refresh"
            )

    async def set(self, device_id: str, language: VoiceLanguage) -> None:
        """Store the device's setting ("auto" removes it); raises ValueError for another value."""
        if language not in VOICE_LANGUAGES:
            raise ValueError(f"a voice language is one of {', '.join(VOICE_LANGUAGES)}")
        async with self._lock:
            if language == "auto":
                await self.db.execute("DELETE FROM device_voice WHERE device_id = ?", (device_id,))
                self._settings.pop(device_id, None)
            else:
                await self.db.execute(_UPSERT, (device_id, language, _now()))
                self._settings[device_id] = language
        log.info("device voice language set", device_id=device_id, language=language)

    def follow(self, registry: "DeviceRegistry") -> None:
        """Drop a device's setting when it is forgotten from the catalogue."""
        self._unsubscribe.append(registry.subscribe(self._on_event))

    def _on_event(self, event: "DeviceEvent") -> None:
        from backend.devices.state import EventKind

        if event.kind is not EventKind.FORGOTTEN or event.origin is not None:
            return
        if event.device_id not in self._settings:
            return
        task = asyncio.get_running_loop().create_task(self._forget(event.device_id))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _forget(self, device_id: str) -> None:
        try:
            await self.set(device_id, "auto")
        except BridgeError as exc:
            log.warning("could not forget a voice language", device_id=device_id, error=str(exc))

    async def _refresh_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(max(every_s, 0.1))
            try:
                await self.load()
            except BridgeError as exc:  # the database is away: keep the copy, try again
                log.warning("could not refresh voice languages", error=str(exc))

    async def aclose(self) -> None:
        """Stop following the registry and refreshing; wait for pending writes."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)


def _now() -> str:
    return datetime.now(UTC).isoformat()
