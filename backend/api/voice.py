"""`/api/devices/{device_id}/voice`: a device's voice language (backend/voice/language.py).

- `GET`: scope `devices:read` covering the device → `{device_id, language, effective,
  languages_available}`; `effective` is the language its next utterance is heard in;
- `PUT` body `{language: "auto" | "en" | "vi"}`: scope `admin`, like the device's other settings
  (its transport); answers as `GET` does.

An unknown device is 404 `unknown_device`; another language is 422.
"""

from collections.abc import Callable
from typing import Annotated, Literal, Protocol

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from backend.api.errors import errors
from backend.api.scopes import needs
from backend.devices import DeviceRegistry
from backend.keys import Principal, Scope

# backend.voice.language.VoiceLanguage, said again: the API does not import the voice package
# (it would join the packages' import circle; tests/test_voice_language.py checks they agree).
VoiceLanguage = Literal["auto", "en", "vi"]

Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]
Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]
PATH = "/api/devices/{device_id}/voice"


class LanguageStore(Protocol):
    """The devices' voice languages (`backend.voice.language.VoiceLanguages`)."""

    def setting(self, device_id: str) -> VoiceLanguage:
        """The device's setting ("auto" when it has none)."""

    async def set(self, device_id: str, language: VoiceLanguage) -> None:
        """Store the device's setting."""


class VoiceLanguageRequest(BaseModel):
    """The body of `PUT /api/devices/{device_id}/voice`."""

    language: VoiceLanguage = Field(
        description='"auto" (the language of its last turns), "en" (Whisper) or "vi" '
        "(the Vietnamese recognizer)"
    )


class VoiceSettings(BaseModel):
    """A device's voice language: its setting, and the language it is heard in now."""

    device_id: str
    language: VoiceLanguage
    effective: str = Field(description="the language its next utterance is heard in")
    languages_available: list[str] = Field(description="what this bridge's recognition hears")


def voice_router(
    store: LanguageStore,
    registry: DeviceRegistry,
    effective: Callable[[str], str],
    available: tuple[str, ...],
) -> APIRouter:
    """The voice language routes; `effective(device_id)` is the language it is heard in."""
    router = APIRouter()

    def view(device_id: str) -> VoiceSettings:
        return VoiceSettings(
            device_id=device_id,
            language=store.setting(device_id),
            effective=effective(device_id),
            languages_available=list(available),
        )

    @router.get(PATH, responses=errors(404))
    async def get_voice(device_id: str, principal: Reader) -> VoiceSettings:
        principal.require_read(device_id)
        registry.summary(device_id)  # UnknownDevice (404) for a device never seen
        return view(device_id)

    @router.put(PATH, responses=errors(404, 503))
    async def set_voice(device_id: str, body: VoiceLanguageRequest, _admin: Admin) -> VoiceSettings:
        registry.summary(device_id)
        await store.set(device_id, body.language)
        return view(device_id)

    return router
