"""`VisionService`: who may upload a photo, how much and how often, and what the model says.

Tokens: a device's vision token is `vtk_` + URL-safe base64 of HMAC-SHA256(the bridge's
credential secret, "vision-token", device id, generation), so nothing is stored and re-approving
a device (a new generation) changes it. It is neither the admin token nor the device's transport
token: it only lets that device upload photos. With `device_auth = "device"` the device must also
be approved with the Client-Id it sends.

An upload is answered with JSON, which the firmware hands to the model verbatim as the tool's
result (protocol reference §4.5): `{"success": true, "text": ...}` with the model's answer, or
`{"success": false, "text": ...}` with a sentence the assistant can say (no vision model
configured, the model failed). Requests that are not a good upload get 400/401/413/415/429 with
`{"success": false, "error": ...}`.
"""

import base64
import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
import structlog

from backend.config import Settings
from backend.logs import LineRate
from backend.provisioning.ratelimit import host_of
from backend.provisioning.tokens import bare_token
from backend.transports.admission import normalize_device_id
from backend.transports.errors import HandshakeRefused
from backend.transports.throttle import ExemptNetworks, KeyedLimiter
from backend.vision.model import VisionFailed, VisionModel
from backend.vision.upload import Upload

log = structlog.get_logger("vision")

VISION_PATH = "/vision/explain"
TOKEN_PREFIX = "vtk_"
AUDIT_TOOL = "vision.explain"
NO_MODEL = (
    "I took the photo, but no vision model is configured on the bridge, so I cannot tell what is "
    "in it. An administrator can set one up."
)
MODEL_FAILED = "I took the photo, but the vision model did not answer, so I cannot describe it."


class DeviceDirectory(Protocol):
    """What the provisioning store tells about a device (its credentials' generation)."""

    def device(self, device_id: str) -> Any:
        """The device's provisioning record (with its `generation`), or None."""

    def approved_for(self, device_id: str, client_id: str | None) -> Any:
        """The device's record if approved for this Client-Id, else None."""


class UploadAudit(Protocol):
    """Where each upload gets its audit row (the device audit log)."""

    def record_upload(
        self,
        device_id: str,
        *,
        tool: str,
        question: str,
        size: int,
        outcome: str,
        error: str | None,
        duration_ms: float,
        actor: str | None = None,
    ) -> None:
        """Record one upload: who (`actor`, by default `device:<device_id>`), the question, its
        size in bytes, the outcome; never the image."""


@dataclass(frozen=True, slots=True)
class VisionAnswer:
    """The HTTP answer to an upload: status, JSON body, headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    device_id: str | None = None  # the Device-Id a refused upload claimed (for the audit row)
    authenticated: bool = False  # the token held: `device_id` is who uploaded, not a claim


def refused(status: int, message: str, **headers: str) -> VisionAnswer:
    """An error answer in the shape the firmware expects (`success: false`)."""
    return VisionAnswer(status, {"success": False, "error": message}, headers)


@dataclass(frozen=True, slots=True)
class Uploader:
    """A device whose token checked out."""

    device_id: str
    client_id: str | None


class VisionService:
    """Admits photo uploads (token, size, rate) and answers them with the vision model."""

    def __init__(
        self,
        settings: Settings,
        secret: bytes,
        devices: DeviceDirectory,
        *,
        audit: UploadAudit | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.max_bytes = settings.vision_max_bytes
        self._secret = secret
        self._devices = devices
        self.audit = audit
        by_ip, by_device = settings.rate_limits["vision_ip"], settings.rate_limits["vision_device"]
        self._ip_limit = KeyedLimiter(by_ip.per_s, by_ip.burst, clock=clock)
        self._device_limit = KeyedLimiter(by_device.per_s, by_device.burst, clock=clock)
        self._exempt = ExemptNetworks(settings.rate_limit_exempt)
        # What a stranger can make us write: refusal lines within a rate per address and in all;
        # audit rows of uploads whose credentials did not hold, as `unauthenticated:<address>`
        # (never as the device they named), 5 per address then 1 a minute, 1/s in all.
        self._refusal_lines = RefusalLines(log)
        self._stranger_rows = KeyedLimiter(1 / 60, 5, clock=clock)
        self._stranger_rows_all = KeyedLimiter(1.0, 30, clock=clock)
        self.unaudited = 0  # refused uploads of strangers past those limits: counted only
        self.model: VisionModel | None = None
        if settings.vision_base_url:
            key = settings.vision_api_key
            self.model = VisionModel(
                settings.vision_base_url,
                settings.vision_model,
                key.get_secret_value() if key is not None else None,
                settings.vision_timeout_s,
                transport=transport,
            )

    async def aclose(self) -> None:
        """Close the vision model's client, if one is configured."""
        if self.model is not None:
            await self.model.aclose()

    # ---- tokens --------------------------------------------------------------------------------

    def token_for(self, device_id: str) -> str:
        """The device's vision token (derived, never stored; changes when it is approved again)."""
        device = self._devices.device(device_id)
        generation = device.generation if device is not None else 0
        message = f"vision-token\0{device_id}\0{generation}".encode()
        digest = hmac.new(self._secret, message, hashlib.sha256).digest()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(digest).decode().rstrip("=")

    # ---- an upload, step by step ---------------------------------------------------------------

    def admit(self, headers: dict[str, str | None], remote: str | None) -> Uploader | VisionAnswer:
        """Address limit, then the token, then the device's own limit (a stranger with a wrong
        token never spends the device's budget)."""
        ip = host_of(remote)
        if ip is not None and ip not in self._exempt and not self._ip_limit.allow(ip):
            return refused(429, "too many uploads from this address; slow down", **_RETRY)
        try:
            device_id = normalize_device_id(headers.get("device_id"))
        except HandshakeRefused as exc:
            return refused(401, f"{exc.reason}: the vision token is checked against it")
        client_id = (headers.get("client_id") or "").strip() or None
        problem = self._token_problem(device_id, client_id, headers.get("authorization"))
        if problem is not None:
            return replace(refused(401, problem, **_CHALLENGE), device_id=device_id)
        if not self._device_limit.allow(device_id):
            answer = refused(429, "too many uploads from this device; slow down", **_RETRY)
            return replace(answer, device_id=device_id, authenticated=True)
        return Uploader(device_id, client_id)

    def _token_problem(
        self, device_id: str, client_id: str | None, authorization: str | None
    ) -> str | None:
        token = bare_token(authorization)
        if not token:
            return "missing Authorization: Bearer <vision token>"
        if not hmac.compare_digest(token.encode(), self.token_for(device_id).encode()):
            return "the vision token is not this device's"
        if (
            self.settings.device_auth == "device"
            and self._devices.approved_for(device_id, client_id) is None
        ):
            return "this device is not approved (or not with this Client-Id)"
        return None

    async def explain(self, who: Uploader, upload: Upload) -> VisionAnswer:
        """The model's answer to the upload (200 either way: the device reads out the text)."""
        if self.model is None:
            return VisionAnswer(200, {"success": False, "text": NO_MODEL})
        try:
            text = await self.model.describe(upload.question, upload.image, upload.media_type)
        except VisionFailed as exc:
            log.warning("vision model failed", device_id=who.device_id, reason=str(exc))
            return VisionAnswer(200, {"success": False, "text": MODEL_FAILED})
        return VisionAnswer(200, {"success": True, "text": text})

    def record(
        self,
        device_id: str | None,
        *,
        question: str,
        size: int,
        answer: VisionAnswer,
        started: float,
        authenticated: bool = True,
        remote: str | None = None,
    ) -> None:
        """The upload's audit row and log line (never the image, never the token).

        `authenticated`: the device's token held, so `device_id` uploaded: a line and a row as
        `device:<id>` (bounded by the device's own upload rate; its 429s, which are not, get
        their line through the budget below, and a row). Otherwise `device_id` is only a
        claim: the line goes through a budget per address, and the row (if any is left in the
        strangers' budget) names the address, never the device."""
        duration_ms = (time.monotonic() - started) * 1000
        outcome = _outcome(answer)
        error = answer.body.get("error") if answer.status != 200 else None
        if answer.status == 200 and not answer.body.get("success"):
            error = "no vision model" if answer.body.get("text") == NO_MODEL else "model failed"
        ip = host_of(remote)
        fields = {"bytes": size, "status": answer.status, "outcome": outcome,
                  "duration_ms": round(duration_ms, 1)}  # fmt: skip
        if authenticated and device_id is not None and answer.status != 429:
            log.info("vision upload", device_id=device_id, **fields)
        else:  # a stranger, or a device past its own rate: at line rate, so budgeted
            self._refusal_lines.write(ip, claimed_device_id=device_id, remote=ip, **fields)
        if self.audit is None or device_id is None:
            return
        if authenticated:
            self.audit.record_upload(
                device_id,
                tool=AUDIT_TOOL,
                question=question,
                size=size,
                outcome=outcome,
                error=error,
                duration_ms=duration_ms,
            )
            return
        stranger = f"unauthenticated:{ip or 'unknown'}"
        if not (self._stranger_rows.allow(stranger) and self._stranger_rows_all.allow("*")):
            self.unaudited += 1
            return
        self.audit.record_upload(
            stranger,
            tool=AUDIT_TOOL,
            question=question,
            size=size,
            outcome=outcome,
            error=f"{error} (claimed Device-Id {device_id})",
            duration_ms=duration_ms,
            actor=stranger,
        )


class RefusalLines:
    """Log lines of refused uploads: at most `burst` at once and `per_minute` a minute per
    address (`LineRate`), and the same in all across addresses (so one host with many addresses
    cannot buy more); a line written after some were left out says how many (`suppressed`)."""

    def __init__(self, logger: Any, *, burst: int = 5, per_minute: float = 10.0) -> None:
        self._log = logger
        self._per_address = LineRate(burst=burst, per_minute=per_minute)
        self._all = LineRate(burst=4 * burst, per_minute=6 * per_minute)
        self.suppressed = 0  # left out since the last line written
        self.written = 0

    def write(self, address: str | None, **fields: Any) -> None:
        """One refused upload from `address`: a line, or a count."""
        if self._per_address.allow(address or "unknown") is None or self._all.allow("*") is None:
            self.suppressed += 1
            return
        self.written += 1
        suppressed, self.suppressed = self.suppressed, 0
        self._log.warning("vision upload refused", suppressed=suppressed, **fields)


_RETRY = {"Retry-After": "10"}
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="vision"'}
_OUTCOMES = {401: "unauthorized", 413: "too_large", 415: "not_image", 429: "refused"}


def _outcome(answer: VisionAnswer) -> str:
    if answer.status == 200:
        if answer.body.get("success"):
            return "ok"
        return "no_model" if answer.body.get("text") == NO_MODEL else "error"
    return _OUTCOMES.get(answer.status, "bad_request")
