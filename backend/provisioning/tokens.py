"""Per-device tokens: derived from the bridge's credential secret, stored only as SHA-256.

A device's token is `dtk_` + URL-safe base64 of HMAC-SHA256(secret, "device-token", device id,
generation). The database keeps its SHA-256 (a copy of the database alone lets nobody in); the
secret (`device-credentials.secret` in the data directory, mode 0600, like the admin token)
lets the OTA endpoint hand an approved device the same token at every boot, as stock firmware
asks for it every time, without the database ever holding it. Approving a device again bumps
its generation, so its earlier token stops working; revoking drops it at once.
"""

import base64
import hashlib
import hmac

TOKEN_PREFIX = "dtk_"
SECRET_FILE = "device-credentials.secret"


def derive_token(secret: bytes, device_id: str, generation: int) -> str:
    """The token of this generation of the device (approving again bumps the generation)."""
    message = f"device-token\0{device_id}\0{generation}".encode()
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def token_hash(token: str) -> str:
    """The stored form of a token: SHA-256, hex (256 random bits need no slow hash)."""
    return hashlib.sha256(token.encode()).hexdigest()


def bare_token(presented: str | None) -> str:
    """The token of an `Authorization` value: `Bearer <token>` or the raw token, as stock
    firmware sends either form."""
    value = (presented or "").strip()
    scheme, _, rest = value.partition(" ")
    if rest and scheme.lower() == "bearer":
        return rest.strip()
    return value


def hmac_sha256_hex(key: bytes, challenge: str) -> str:
    """What a device with an eFuse serial number answers to an activation challenge (§5.3)."""
    return hmac.new(key, challenge.encode(), hashlib.sha256).hexdigest()
