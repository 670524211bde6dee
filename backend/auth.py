"""Tokens for devices and for the admin API.

Auth is on by default. Tokens come from settings (`BRIDGE_ADMIN_TOKEN`, `BRIDGE_DEVICE_TOKEN`);
when unset, `serve` creates them once in the data directory (mode 0600), where `simulate`,
`demo` and the CLI on the same machine find them. The shared device token exists only in the
development mode `device_auth = "shared"`; by default every device has its own token
(`backend.provisioning`). Tokens never reach the logs.
"""

import errno
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from backend.config import Settings

ADMIN_TOKEN_FILE = "admin.token"
DEVICE_TOKEN_FILE = "device.token"


@dataclass(frozen=True)
class Tokens:
    """The bridge's own secrets: the admin token, the shared device token, and the files just
    created for them."""

    admin: str
    device: str | None = None  # the shared device token (device_auth = "shared" only)
    created: list[Path] = field(default_factory=list)


def ensure_tokens(settings: Settings) -> Tokens:
    """Return the configured tokens, creating missing ones in the data directory."""
    created: list[Path] = []
    admin = _configured(settings.admin_token) or _load_or_create(
        settings.data_dir / ADMIN_TOKEN_FILE, created
    )
    device = _configured(settings.device_token)
    if device is None and settings.device_auth == "shared":
        device = _load_or_create(settings.data_dir / DEVICE_TOKEN_FILE, created)
    return Tokens(admin=admin, device=device, created=created)


def read_token(data_dir: Path, name: str) -> str | None:
    """Read a token file written by `serve`, or None when it does not exist."""
    try:
        value = (data_dir / name).read_text().strip()
    except OSError:
        return None
    return value or None


def token_matches(presented: str | None, expected: str) -> bool:
    """Accept `Bearer <token>` or the raw token, as stock firmware sends either form."""
    if not presented:
        return False
    presented = presented.strip()
    scheme, _, rest = presented.partition(" ")
    if rest and scheme.lower() == "bearer":
        presented = rest.strip()
    return hmac.compare_digest(presented.encode(), expected.encode())


def load_or_create_secret(path: Path, created: list[Path]) -> str:
    """The secret in `path`, created (random, mode 0600) when missing; new files go to
    `created` so the caller can say so."""
    return _load_or_create(path, created)


def _configured(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() or None if secret is not None else None


def _load_or_create(path: Path, created: list[Path]) -> str:
    existing = read_token(path.parent, path.name)
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + 0600: never readable by others, never clobbers a concurrent writer's token.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # A concurrent writer's token, or a path that holds none (empty file, directory,
        # unreadable): serving with a token kept only in memory would lock the CLI out.
        written = read_token(path.parent, path.name)
        if written is None:
            raise OSError(errno.EINVAL, "exists but holds no token", str(path)) from None
        return written
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    created.append(path)
    return token
