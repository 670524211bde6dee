"""Admin API routes of provisioning, firmware releases and the audit log (scope `admin`).

- `GET /api/provisioning/pending`: `{pending: [{code, device_id, client_id, serial_number,
  serial_check, remote, board, firmware, chip, created_at, last_seen, candidates}]}`
  (`candidates`: how many pending requests claim that device id);
- `POST /api/provisioning/approve`: body `{target: CODE or DEVICE_ID, transport?}` (by device
  id only while one request claims it: 409 `ambiguous_activation` otherwise);
- `GET /api/provisioning/devices`: `{devices: [{device_id, client_id, status, generation, ...}]}`;
- `POST /api/provisioning/devices/{device_id}/revoke`: its live link is closed at once;
- `PUT /api/provisioning/devices/{device_id}/transport`: body `{transport}` (or null);
- `POST /api/provisioning/enrollment-codes`: body `{name?, uses?, ttl_s?, transport?}` → 201
  with `code` and `ota_url` (shown once); `GET` lists them, `DELETE .../{id}` revokes one;
- `PUT /api/provisioning/serial-keys/{serial}` body `{key: hex}`, `DELETE`, `GET` (serials);
- `GET /api/provisioning/mosquitto-passwd`: a Mosquitto `password_file` of approved devices;
- `PUT /api/firmware/{board}/{version}` body: the image itself (application/octet-stream, up to
  32 MiB) → 201; `POST /api/firmware` body `{board, version, path}` with `path` a file inside
  the bridge's firmware folder (relative to it, or absolute) → 201; anything else is 422;
  `GET /api/firmware`; `DELETE /api/firmware/{board}/{version}`;
- `DELETE /api/provisioning/pending/{code}`: rejects (forgets) a pending request; a device that
  polls again gets a new code;
- `GET /api/audit?device_id=&tool=&actor=&outcome=&since=&until=&before=&limit=`:
  `{entries, next_before}`, newest first (`before`: the previous page's `next_before`; `since`
  inclusive, `until` exclusive, RFC 3339 times with their zone); with `device_id`, a key with
  devices:read covering that device may read it too (the console's device page shows a device's
  recent calls).
"""

import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, BeforeValidator, Field

from backend.api.errors import errors
from backend.api.scopes import actor_of, needs, principal_of
from backend.devices.audit import AuditEntry, AuditLog
from backend.keys import Principal, Scope
from backend.provisioning.errors import InvalidInput, InvalidRelease
from backend.provisioning.service import Provisioning
from backend.transports.mqtt_credentials import mosquitto_password_file

Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]
# The checks of backend/provisioning/releases.py (check_board, check_version) and of the serial key
# store, said in the schema; the code's own checks stay, with their messages.
BOARD_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
VERSION_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$"
Board = Annotated[str, PathParam(json_schema_extra={"pattern": BOARD_PATTERN})]
Version = Annotated[str, PathParam(json_schema_extra={"pattern": VERSION_PATTERN})]
Serial = Annotated[
    str, PathParam(min_length=1, max_length=64, description="1 to 64 printable characters")
]
TransportName = Literal["websocket", "mqtt"]


class ApproveRequest(BaseModel):
    """The body of an approval: the pending request's code or device, and the transport to use."""

    target: str = Field(min_length=1, max_length=128)
    transport: TransportName | None = None


class TransportRequest(BaseModel):
    """The transport a device is told to use (null: the bridge's default)."""

    transport: TransportName | None


class EnrollmentRequest(BaseModel):
    """The body of a new enrollment code: name, uses, lifetime in seconds, transport."""

    name: str = Field("enrollment", max_length=100)
    uses: int = Field(1, ge=1, le=1_000_000)
    ttl_s: float | None = Field(3600.0, gt=0, le=366 * 86400)  # at most a year
    transport: TransportName | None = None


class SerialKeyRequest(BaseModel):
    """The HMAC key of a serial number, as 16 to 64 bytes of hex."""

    key: str = Field(
        min_length=32,
        max_length=128,
        pattern="^[0-9A-Fa-f]+$",
        # Whole bytes: the route's own check (with its message) refuses an odd count.
        json_schema_extra={"pattern": "^([0-9A-Fa-f]{2})+$"},
    )


class PublishRequest(BaseModel):
    """The body of publishing a firmware file already in the releases folder."""

    board: str = Field(min_length=1, max_length=64, json_schema_extra={"pattern": BOARD_PATTERN})
    version: str = Field(
        min_length=1, max_length=40, json_schema_extra={"pattern": VERSION_PATTERN}
    )
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="a file inside the bridge's firmware folder: relative to it, or an absolute"
        " path that resolves (symlinks followed) inside it; anything else is 422",
    )


Outcome = Literal["ok", "tool_error", "error", "refused"]
# RFC 3339, as the schema's `date-time` says: seconds and a zone required (pydantic alone would
# also take a number as Unix seconds, or a date without its time).
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})")


def _rfc3339(value: object) -> object:
    if isinstance(value, str) and _RFC3339.fullmatch(value) is None:
        raise ValueError("an RFC 3339 time with its zone, e.g. 2026-11-29T15:30:00Z")
    return value


Moment = Annotated[datetime, BeforeValidator(_rfc3339)]
CODE_PATTERN = r"^[0-9]{1,16}$"


class AuditEntryView(BaseModel):
    """One audit row: a device tool call (or photo upload); the arguments only as a digest."""

    id: int
    at: str = Field(description="ISO-8601 UTC")
    actor: str | None = Field(description="`admin`, `key:<id>`, `chat:...` or `device:<id>`")
    device_id: str
    tool: str
    arguments_sha256: str
    outcome: str = Field(description="ok, tool_error, error or refused")
    error: str | None
    confirmed: bool
    duration_ms: float
    bytes: int | None = Field(None, description="a photo upload's size (null for tool calls)")


class AuditPage(BaseModel):
    """A page of `GET /api/audit`, newest first."""

    entries: list[AuditEntryView]
    next_before: int | None = Field(
        description="pass as `before` for the next (older) page; null on the last page"
    )


def audit_page(entries: list[AuditEntry], limit: int) -> AuditPage:
    """The page of these rows: `next_before` only when the page is full."""
    return AuditPage(
        entries=[AuditEntryView(**entry.to_json()) for entry in entries],
        next_before=entries[-1].id if len(entries) == limit else None,
    )


def provisioning_router(service: Provisioning, audit: AuditLog) -> APIRouter:
    """Admin routes of provisioning: requests, devices, enrollment codes, serial keys, releases."""
    return ProvisioningRoutes(service, audit).router()


class ProvisioningRoutes:
    """The handlers of provisioning's admin routes, and of the audit log's."""

    def __init__(self, service: Provisioning, audit: AuditLog) -> None:
        self.service = service
        self.store = service.store
        self.audit = audit

    def router(self) -> APIRouter:
        """The routes, each on its handler below."""
        router = APIRouter()
        add = router.add_api_route
        add("/api/provisioning/pending", self.pending, methods=["GET"])
        add(
            "/api/provisioning/approve",
            self.approve,
            methods=["POST"],
            responses=errors(404, 409, 503),
        )
        add(
            "/api/provisioning/pending/{code}",
            self.reject,
            methods=["DELETE"],
            responses=errors(404, 503),
        )
        add("/api/provisioning/devices", self.devices, methods=["GET"])
        add(
            "/api/provisioning/devices/{device_id}/revoke",
            self.revoke,
            methods=["POST"],
            responses=errors(404, 503),
        )
        add(
            "/api/provisioning/devices/{device_id}/transport",
            self.set_transport,
            methods=["PUT"],
            responses=errors(404, 503),
        )
        add(
            "/api/provisioning/enrollment-codes",
            self.create_enrollment,
            methods=["POST"],
            status_code=201,
            responses=errors(503),
        )
        add("/api/provisioning/enrollment-codes", self.enrollments, methods=["GET"])
        add(
            "/api/provisioning/enrollment-codes/{enrollment_id}",
            self.revoke_enrollment,
            methods=["DELETE"],
            responses=errors(404, 503),
        )
        add("/api/provisioning/serial-keys", self.serial_keys, methods=["GET"])
        add(
            "/api/provisioning/serial-keys/{serial}",
            self.set_serial_key,
            methods=["PUT"],
            status_code=204,
            responses=errors(503),
        )
        add(
            "/api/provisioning/serial-keys/{serial}",
            self.remove_serial_key,
            methods=["DELETE"],
            status_code=204,
            responses=errors(404, 503),
        )
        add(
            "/api/provisioning/mosquitto-passwd",
            self.mosquitto_passwd,
            methods=["GET"],
            response_class=PlainTextResponse,
        )
        add("/api/firmware", self.publish, methods=["POST"], status_code=201, responses=errors(422))
        add(
            "/api/firmware/{board}/{version}",
            self.upload,
            methods=["PUT"],
            status_code=201,
            responses=errors(422),
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/octet-stream": {
                            "schema": {"type": "string", "format": "binary", "minLength": 1}
                        }
                    },
                }
            },
        )
        add("/api/firmware", self.releases, methods=["GET"])
        add(
            "/api/firmware/{board}/{version}",
            self.unpublish,
            methods=["DELETE"],
            responses=errors(404),
        )
        add("/api/audit", self.audit_entries, methods=["GET"], responses=errors(503))
        return router

    async def pending(self, _admin: Admin) -> dict[str, Any]:
        """Activation requests waiting for an operator."""
        return {"pending": self.store.pending_json()}

    async def approve(self, body: ApproveRequest, principal: Admin) -> dict[str, Any]:
        """Approve a device by the code it shows (or its id when one request names it)."""
        device = await self.service.approve(
            body.target, by=actor_of(principal), transport=body.transport
        )
        return device.to_json()

    async def reject(
        self,
        code: Annotated[str, PathParam(pattern=CODE_PATTERN, description="the code it shows")],
        principal: Admin,
    ) -> dict[str, Any]:
        """Reject (forget) the waiting request with this code."""
        request = await self.store.reject(code, by=actor_of(principal))
        return request.to_json(key_registered=False)

    async def devices(self, _admin: Admin) -> dict[str, Any]:
        """Approved and revoked devices."""
        return {"devices": [device.to_json() for device in self.store.devices()]}

    async def revoke(self, device_id: str, principal: Admin) -> dict[str, Any]:
        """Revoke a device: its token stops working, its live link is closed."""
        return (await self.service.revoke(device_id, by=actor_of(principal))).to_json()

    async def set_transport(
        self, device_id: str, body: TransportRequest, _admin: Admin
    ) -> dict[str, Any]:
        """The transport a device's next OTA answer hands it."""
        return (await self.store.set_transport(device_id, body.transport)).to_json()

    async def create_enrollment(self, body: EnrollmentRequest, _admin: Admin) -> dict[str, Any]:
        """An enrollment code that approves up to `uses` devices by itself."""
        enrollment, code = await self.store.create_enrollment(
            body.name, uses=body.uses, ttl_s=body.ttl_s, transport=body.transport
        )
        return {**enrollment.to_json(), "code": code, "ota_url": self.service.enrollment_url(code)}

    async def enrollments(self, _admin: Admin) -> dict[str, Any]:
        """The enrollment codes (never the codes themselves)."""
        return {"enrollment_codes": [e.to_json() for e in self.store.enrollments()]}

    async def revoke_enrollment(self, enrollment_id: str, _admin: Admin) -> dict[str, Any]:
        """Revoke an enrollment code."""
        return (await self.store.revoke_enrollment(enrollment_id)).to_json()

    async def serial_keys(self, _admin: Admin) -> dict[str, Any]:
        """The serial numbers with a registered HMAC key (never the keys)."""
        return {"serial_numbers": self.store.serial_numbers()}

    async def set_serial_key(
        self, serial: Serial, body: SerialKeyRequest, _admin: Admin
    ) -> Response:
        """Register the HMAC key of an eFuse serial number."""
        if len(body.key) % 2:
            raise InvalidInput("the key must be an even number of hex digits")
        await self.store.set_serial_key(serial, bytes.fromhex(body.key))
        return Response(status_code=204)

    async def remove_serial_key(self, serial: Serial, _admin: Admin) -> Response:
        """Remove a serial number's HMAC key."""
        await self.store.remove_serial_key(serial)
        return Response(status_code=204)

    async def mosquitto_passwd(self, _admin: Admin) -> Response:
        """A Mosquitto password file with every approved device's broker login."""
        logins = self.store.broker_logins()
        text = mosquitto_password_file(logins) if logins else ""
        return Response(text, media_type="text/plain")

    async def publish(self, body: PublishRequest, _admin: Admin) -> dict[str, Any]:
        """Publish a firmware file from the data directory's firmware folder."""
        if "\x00" in body.path:
            raise InvalidRelease("the path contains a NUL character")
        release = await self.service.releases.publish(body.board, body.version, Path(body.path))
        return release.to_json()

    async def upload(
        self, board: Board, version: Version, request: Request, _admin: Admin
    ) -> dict[str, Any]:
        """Publish a firmware image sent as the body."""
        # The gate lets an admin's body here reach 32 MiB; the store streams it to disk.
        release = await self.service.releases.upload(board, version, request.stream())
        return release.to_json()

    async def releases(self, _admin: Admin) -> dict[str, Any]:
        """The published firmware releases."""
        return {"releases": [release.to_json() for release in self.service.releases.releases()]}

    async def unpublish(self, board: Board, version: Version, _admin: Admin) -> dict[str, Any]:
        """Stop offering a firmware release."""
        return (await self.service.releases.unpublish(board, version)).to_json()

    async def audit_entries(
        self,
        request: Request,
        device_id: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        tool: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
        actor: Annotated[str | None, Query(min_length=1, max_length=128)] = None,
        outcome: Outcome | None = None,
        since: Annotated[Moment | None, Query(description="from this time (RFC 3339)")] = None,
        until: Annotated[Moment | None, Query(description="before this time (RFC 3339)")] = None,
        before: Annotated[int | None, Query(ge=1, le=2**62)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> AuditPage:
        """The audit log of tool calls, newest first, filtered and paged."""
        principal = principal_of(request)
        if device_id is None:
            principal.require(Scope.ADMIN)
        else:  # admin, or devices:read covering this device
            principal.require_read(device_id)
        entries = await self.audit.entries(
            device_id=device_id,
            tool=tool,
            actor=actor,
            outcome=outcome,
            since=since.timestamp() if since else None,
            until=until.timestamp() if until else None,
            before=before,
            limit=limit,
        )
        return audit_page(entries, limit)
