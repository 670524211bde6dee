"""A small client for the admin API, used by the CLI. Every failure becomes `AdminError` with
one line for the user."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from backend.errors import BridgeError


class AdminError(BridgeError):
    """A failed admin request; the message is one line for the user."""


class AdminClient:
    """`token_source` names where the token came from (a refused token says what to check);
    `unreachable_hint` says how to point at another bridge when this one does not answer."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout_s: float = 10.0,
        *,
        token_source: str = "--token or BRIDGE_ADMIN_TOKEN",
        unreachable_hint: str = "is it running?",
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.token_source = token_source
        self.unreachable_hint = unreachable_hint
        with self._errors():  # a URL httpx cannot parse fails here, before any request
            self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *_exc: object) -> None:
        self._http.close()

    def devices(self, *, online: bool | None = None, page_size: int = 1000) -> list[dict[str, Any]]:
        """Every device (all pages), live and offline; `online` filters."""
        devices: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = {"limit": str(page_size)}
            if online is not None:
                params["online"] = "true" if online else "false"
            if cursor is not None:
                params["cursor"] = cursor
            page = self._request("GET", "/api/devices", params)
            devices += page["devices"]
            cursor = page.get("next_cursor")
            if not cursor:
                return devices

    def device(self, device_id: str) -> dict[str, Any]:
        """The device's row; raises AdminError."""
        return _object(self._request("GET", f"/api/devices/{quote(device_id, safe='')}"))

    def forget(self, device_id: str) -> None:
        """Forget an offline device; raises AdminError."""
        self._request("DELETE", f"/api/devices/{quote(device_id, safe='')}")

    def tools(self, device_id: str, *, include_user_only: bool = True) -> dict[str, Any]:
        """`{device_id, state, cached, read_at, tools}`; `cached` for an offline device."""
        params = {"user": "true" if include_user_only else "false"}
        path = f"/api/devices/{quote(device_id, safe='')}/tools"
        return _object(self._request("GET", path, params))

    def call(
        self,
        device_id: str,
        name: str,
        arguments: dict[str, Any],
        timeout_s: float | None = None,
        *,
        confirm: bool = False,
    ) -> dict[str, Any]:
        """Call a device tool (with `confirm` for a risky one); raises AdminError."""
        body: dict[str, Any] = {"name": name, "arguments": arguments}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if confirm:
            body["confirm"] = True
        path = f"/api/devices/{quote(device_id, safe='')}/tools/call"
        # The HTTP wait must outlast the tool's own timeout, so the server's 504 reaches us.
        wait = (timeout_s or 30.0) + 5.0
        return _object(self._request("POST", path, json=body, timeout=wait))

    # ---- API keys (scope admin) ---------------------------------------------------------------

    def create_key(
        self, name: str, scopes: list[str], device_ids: list[str] | None = None
    ) -> dict[str, Any]:
        """The new key, with its `token` (shown once)."""
        body: dict[str, Any] = {"name": name, "scopes": scopes}
        if device_ids:
            body["device_ids"] = device_ids
        return _object(self._request("POST", "/api/keys", json=body))

    def keys(self, *, include_revoked: bool = True) -> list[dict[str, Any]]:
        """The API keys (revoked ones too unless told otherwise); raises AdminError."""
        params = {"revoked": "true" if include_revoked else "false"}
        listed: list[dict[str, Any]] = _object(self._request("GET", "/api/keys", params))["keys"]
        return listed

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        """Revoke an API key; raises AdminError."""
        return _object(self._request("DELETE", f"/api/keys/{quote(key_id, safe='')}"))

    # ---- provisioning, firmware releases, audit (scope admin) ---------------------------------

    def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        """GET an API path, expecting a JSON object; raises AdminError."""
        return _object(self._request("GET", path, params))

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST a JSON body, expecting a JSON object; raises AdminError."""
        return _object(self._request("POST", path, json=body or {}))

    def put(self, path: str, body: dict[str, Any]) -> Any:
        """PUT a JSON body; the JSON answer (None for 204); raises AdminError."""
        return self._request("PUT", path, json=body)

    def delete(self, path: str) -> Any:
        """DELETE an API path; the JSON answer (None for 204); raises AdminError."""
        return self._request("DELETE", path)

    def upload(self, path: str, file: Path, timeout_s: float = 300.0) -> dict[str, Any]:
        """PUT a file's bytes (a firmware image) as application/octet-stream."""
        headers = {"Content-Type": "application/octet-stream"}
        with self._errors(), file.open("rb") as reader:
            response = self._http.put(path, content=reader, headers=headers, timeout=timeout_s)
        if not response.is_success:
            raise AdminError(self._error_message(response))
        return _object(response.json())

    def text(self, path: str) -> str:
        """GET a path whose answer is text (e.g. a mosquitto password file); raises AdminError."""
        with self._errors():
            response = self._http.get(path)
        if not response.is_success:
            raise AdminError(self._error_message(response))
        return response.text

    # ---- chat (scope chat:use) -----------------------------------------------------------------

    def chat(
        self,
        message: str,
        *,
        conversation_id: str | None = None,
        device_id: str | None = None,
        timeout_s: float = 300.0,
    ) -> Iterator[dict[str, Any]]:
        """One turn through `POST /api/chat/stream`: its events, as they arrive."""
        body: dict[str, Any] = {"message": message}
        if conversation_id:
            body["conversation_id"] = conversation_id
        if device_id:
            body["device_id"] = device_id
        with self._errors():
            stream = self._http.stream("POST", "/api/chat/stream", json=body, timeout=timeout_s)
            with stream as response:
                if not response.is_success:
                    response.read()
                    raise AdminError(self._error_message(response))
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        yield _object(json.loads(line[len("data: ") :]))

    def _request(
        self, method: str, path: str, params: dict[str, str] | None = None, **kwargs: Any
    ) -> Any:
        with self._errors():
            response = self._http.request(method, path, params=params, **kwargs)
        if response.status_code == 204:
            return None
        if response.is_success:
            return response.json()
        raise AdminError(self._error_message(response))

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Transport failures as one line for the user."""
        try:
            yield
        except httpx.ConnectError:
            raise AdminError(
                f"cannot reach the bridge at {self.base_url}: {self.unreachable_hint}"
            ) from None
        except httpx.TimeoutException:
            raise AdminError(f"the bridge at {self.base_url} did not answer in time") from None
        except httpx.InvalidURL as exc:  # not an HTTPError: a bad --server or bridge.json URL
            raise AdminError(f"the bridge URL {self.base_url} is not valid: {exc}") from None
        except httpx.HTTPError as exc:
            raise AdminError(f"request to {self.base_url} failed: {exc}") from None

    def _error_message(self, response: httpx.Response) -> str:
        try:
            error = response.json()["error"]
            message = f"{error['message']} ({error['code']})"
        except (ValueError, KeyError, TypeError):
            message = response.text.strip()[:200] or response.reason_phrase
        if response.status_code == 401:
            return f"{message}: check {self.token_source}"
        if response.status_code == 403:
            return f"{message}: use a key with that scope, or the admin token"
        return f"HTTP {response.status_code}: {message}"


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AdminError("the bridge answered with something other than a JSON object")
    return value
