"""The voice loop for the bridge's settings: the real one, or a notice saying why not."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog

from backend.config import Settings
from backend.devices import DeviceRegistry
from backend.devices.conversation import ConversationHub
from backend.dialogue.device_chat import DeviceChat
from backend.voice import missing_voice_packages
from backend.voice.errors import VoiceUnavailable

if TYPE_CHECKING:
    from backend.voice.service import VoiceService

log = structlog.get_logger("voice")


class VoiceLoop(Protocol):
    """What the bridge starts and stops for voice: the voice service or the notice that
    stands in."""

    async def start(self) -> None:
        """Load what it needs and subscribe to the devices."""

    async def stop(self) -> None:
        """Unsubscribe and release what it holds."""


LanguageOf = Callable[[str], str | None]


def build_voice(
    settings: Settings,
    hub: ConversationHub,
    registry: DeviceRegistry,
    device_chat: DeviceChat,
    languages: LanguageOf | None = None,
) -> VoiceLoop:
    """`VoiceService` when voice is on and its packages and engines load; otherwise a
    `VoiceUnavailableNotice` (devices get text answers and are told why). `languages` is each
    device's voice language setting (None for "auto"; backend/voice/language.py)."""
    from backend.voice.service import VoiceUnavailableNotice

    reason = _unavailable_reason(settings)
    if reason is None:
        try:
            service = _voice_service(settings, hub, registry, device_chat)
            if languages is not None:
                service.languages = languages
            return service
        except VoiceUnavailable as exc:
            reason = str(exc)
    if settings.voice_enabled:
        log.warning("voice unavailable: devices get text answers", reason=reason)
    return VoiceUnavailableNotice(hub, reason)


def _unavailable_reason(settings: Settings) -> str | None:
    if not settings.voice_enabled:
        return "voice is turned off on this bridge (voice_enabled = false)"
    if settings.asr_provider == "none" or settings.tts_provider == "none":
        return "speech recognition or synthesis is turned off (asr_provider/tts_provider)"
    missing = missing_voice_packages(embedded_recognizer=settings.asr_provider == "embedded")
    if missing:
        return "voice packages missing: " + ", ".join(missing) + " (pip install '.[voice]')"
    return None


def _voice_service(
    settings: Settings, hub: ConversationHub, registry: DeviceRegistry, device_chat: DeviceChat
) -> "VoiceService":
    from backend.voice.recognition import recognizer_from_settings
    from backend.voice.recognition.vocabulary import prompt_for
    from backend.voice.service import VoiceService
    from backend.voice.tts import synthesizer_from_settings

    recognizer = recognizer_from_settings(settings)
    synthesizer = synthesizer_from_settings(settings)
    if recognizer is None or synthesizer is None:
        raise VoiceUnavailable("speech recognition or synthesis is turned off")
    return VoiceService(settings, hub, registry, device_chat, recognizer, synthesizer, prompt_for)
