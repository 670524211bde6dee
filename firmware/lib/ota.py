"""OTA check, activation and bundle updates: protocol reference §5, the device side.

At boot the firmware POSTs its system info to its OTA URL, as stock firmware does, and learns
from the answer where its bridge is and how to log in: `websocket` {url, token}, or `mqtt` with
its broker login and topics, which chooses the MQTT transport. A device the bridge does not know
yet gets an `activation` {code, message, challenge}: it shows the code and polls
`<ota_url>/activate` (202 pending, 200 approved) until the operator approves it, then checks
again. A `firmware` offer of a newer version is a bundle of the firmware's files
(backend/provisioning/bundle.py): `apply_bundle` streams it into `<name>.new` files, checks every
file's size and SHA-256 and the whole bundle's, and only then renames them over the old ones
and writes `version` (which the firmware reports from then on, so an upgrade cannot loop).

Runs unchanged on the ESP32, the unix port and CPython (the simulator). http:// only.
"""

import asyncio
import json
import os
from binascii import hexlify

from compat import const

HTTP_TIMEOUT_S = 15
RETRY_MIN_S = 10
RETRY_MAX_S = 300
ACTIVATE_POLL_S = 3
ACTIVATE_TRIES = const(10)
MAX_ANSWER = const(16384)
_MAX_HEADER_LINES = const(64)
_CHUNK = const(1024)
BUNDLE_MAGIC = b"EMB1\n"
VERSION_FILE = "version"


class OtaError(Exception):
    """The OTA server could not be reached or gave an unusable answer."""


# ---- pure helpers -------------------------------------------------------------------------------


def parse_http_url(url):
    """(host, port, path) of http://host[:port][/path]; ValueError for anything else."""
    if not isinstance(url, str) or not url.startswith("http://"):
        raise ValueError("OTA URL must start with http:// (TLS is not supported): " + str(url))
    rest = url[7:]
    slash = rest.find("/")
    authority, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
    host, port = authority, 80
    colon = authority.rfind(":")
    if colon >= 0:
        host, digits = authority[:colon], authority[colon + 1 :]
        if not digits.isdigit() or not 0 < int(digits) < 65536:
            raise ValueError("bad port in OTA URL: " + url)
        port = int(digits)
    if not host or " " in host or "@" in host or " " in path:
        raise ValueError("bad OTA URL: " + url)
    return host, port, path


def activate_url(ota_url):
    """Where activation is polled: the OTA URL + "activate" (a "/" inserted if missing)."""
    return ota_url + ("activate" if ota_url.endswith("/") else "/activate")


def version_tuple(text):
    """Dot-separated integers, or None (compare nothing else: never upgrade on a guess)."""
    if not isinstance(text, str) or not text:
        return None
    parts = text.split(".")
    for part in parts:
        if not part.isdigit():
            return None
    return tuple(int(part) for part in parts)


def is_newer(candidate, current) -> bool:
    new, old = version_tuple(candidate), version_tuple(current)
    if new is None or old is None:
        return False
    width = max(len(new), len(old))
    return new + (0,) * (width - len(new)) > old + (0,) * (width - len(old))


def request_headers(device_id, client_id, user_agent, language="en-US"):
    """The §5.1 request headers (Activation-Version 1: this firmware has no eFuse serial)."""
    return {
        "Activation-Version": "1",
        "Device-Id": device_id,
        "Client-Id": client_id,
        "User-Agent": user_agent,
        "Accept-Language": language,
        "Content-Type": "application/json",
    }


def offered_update(answer, current_version):
    """The answer's `firmware` section if it offers a newer version with a URL, else None."""
    firmware = answer.get("firmware") if isinstance(answer, dict) else None
    if not isinstance(firmware, dict):
        return None
    url, version = firmware.get("url"), firmware.get("version")
    if not isinstance(url, str) or not url or not is_newer(version, current_version):
        return None
    return firmware


def websocket_endpoint(answer):
    """(url, token) of the answer's `websocket` section; OtaError when it has none."""
    section = answer.get("websocket") if isinstance(answer, dict) else None
    if not isinstance(section, dict) or not isinstance(section.get("url"), str):
        raise OtaError("the OTA answer has no websocket section")
    token = section.get("token")
    return section["url"], token if isinstance(token, str) else ""


def mqtt_settings(answer, local=None):
    """The MqttTransport config of the answer's `mqtt` section (§2.1): its login, client id and
    topics, over the device's own `mqtt` config (tuning such as `stock` and `keepalive`, which
    wins over the answer's). The stock port rule: no port or 8883 means TLS. OtaError when the
    answer has no usable section."""
    section = answer.get("mqtt") if isinstance(answer, dict) else None
    if not isinstance(section, dict):
        raise OtaError("the OTA answer has no mqtt section")
    for name in ("endpoint", "username", "password"):
        value = section.get(name)
        if not isinstance(value, str) or not value:
            raise OtaError("the OTA answer's mqtt section has no " + name)
    settings = dict(local) if isinstance(local, dict) else {}
    settings["url"] = _broker_url(section["endpoint"])
    settings["username"], settings["password"] = section["username"], section["password"]
    for name in ("client_id", "publish_topic", "subscribe_topic"):
        if isinstance(section.get(name), str) and section[name]:
            settings[name] = section[name]
    publish = settings.get("publish_topic")
    if publish and publish.endswith("/up") and not settings.get("status_topic"):
        settings["status_topic"] = publish[:-3] + "/status"  # the scheme's sibling topic
    keepalive = section.get("keepalive")
    if settings.get("keepalive") is None and isinstance(keepalive, int) and keepalive > 0:
        settings["keepalive"] = keepalive
    return settings


def _broker_url(endpoint):
    host, port = endpoint, "8883"
    colon = endpoint.rfind(":")
    if colon >= 0:
        host, port = endpoint[:colon], endpoint[colon + 1 :]
    if not host or not port.isdigit():
        raise OtaError("the OTA answer's mqtt endpoint is not host[:port]: " + endpoint)
    return ("mqtts://" if port == "8883" else "mqtt://") + host + ":" + port


# ---- HTTP ---------------------------------------------------------------------------------------


async def _readline(reader):
    return await reader.readline()


async def _read(reader, count):
    return await reader.read(count)


async def _open(host, port):
    return await asyncio.open_connection(host, port)


async def http_request(method, url, headers, body=None, sink=None, timeout_s=HTTP_TIMEOUT_S):
    """(status, body) of one request (Connection: close). With `sink`, a 200 body goes to
    `sink(chunk)` and None is returned; other bodies are capped at MAX_ANSWER bytes."""
    host, port, path = parse_http_url(url)
    data = body.encode() if isinstance(body, str) else (body or b"")
    try:
        reader, writer = await asyncio.wait_for(_open(host, port), timeout_s)
    except asyncio.TimeoutError:
        raise OSError("connecting to " + host + ":" + str(port) + " timed out")
    try:
        lines = [
            method + " " + path + " HTTP/1.1",
            "Host: " + host + ("" if port == 80 else ":" + str(port)),
            "Connection: close",
            "Content-Length: " + str(len(data)),
        ]
        for name in headers:
            lines.append(name + ": " + str(headers[name]))
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        await writer.drain()
        status_line = await asyncio.wait_for(_readline(reader), timeout_s)
        parts = status_line.split(b" ")
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise OtaError("not an HTTP response: " + repr(status_line[:60]))
        status = int(parts[1])
        length = None
        for _ in range(_MAX_HEADER_LINES):
            line = await asyncio.wait_for(_readline(reader), timeout_s)
            if line in (b"\r\n", b"\n", b""):
                break
            colon = line.find(b":")
            if colon > 0 and line[:colon].strip().lower() == b"content-length":
                length = int(line[colon + 1 :].strip())
        else:
            raise OtaError("too many header lines")
        if status != 200:
            sink = None
        received = 0
        kept = []
        while length is None or received < length:
            want = _CHUNK if length is None else min(_CHUNK, length - received)
            chunk = await asyncio.wait_for(_read(reader, want), timeout_s)
            if not chunk:
                if length is not None:
                    raise OtaError("connection closed after %d of %d bytes" % (received, length))
                break
            received += len(chunk)
            if sink is not None:
                sink(chunk)
            elif received > MAX_ANSWER:
                raise OtaError("answer larger than %d bytes" % MAX_ANSWER)
            else:
                kept.append(chunk)
        return status, (None if sink is not None else b"".join(kept))
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except Exception:  # the connection is being dropped anyway
            pass


async def post_json(url, headers, value, timeout_s=HTTP_TIMEOUT_S):
    """(status, parsed JSON object or None)."""
    text = json.dumps(value, separators=(",", ":"))
    status, raw = await http_request("POST", url, headers, text, timeout_s=timeout_s)
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    return status, parsed if isinstance(parsed, dict) else None


# ---- the boot-time exchange ------------------------------------------------------------------


async def provision(ota_url, hal, device_id, client_id, log=print, retry_min_s=RETRY_MIN_S,
                    poll_s=ACTIVATE_POLL_S):  # fmt: skip
    """The OTA answer with this device's credentials: checks, activates (showing the code)
    and retries with backoff until the bridge hands them out."""
    agent = hal.board_name + "/" + hal.firmware_version
    headers = request_headers(device_id, client_id, agent)
    delay = retry_min_s
    while True:
        try:
            status, answer = await post_json(ota_url, headers, hal.system_info())
            if status != 200 or answer is None:
                raise OtaError("OTA check answered HTTP " + str(status))
        except (OSError, OtaError, ValueError) as error:
            log("ota: " + str(error) + "; next try in " + str(delay) + " s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)
            continue
        delay = retry_min_s
        activation = answer.get("activation")
        if not isinstance(activation, dict):
            return answer
        await _activate(ota_url, headers, activation, hal, log, poll_s, retry_min_s)


async def _activate(ota_url, headers, activation, hal, log, poll_s, retry_s):
    code = activation.get("code")
    message = activation.get("message") or ("Activation code " + str(code))
    log("ota: activation code " + str(code) + ": approve it on the bridge")
    try:
        hal.show("system", str(message))
    except Exception:  # a display that fails must not stop the activation
        pass
    url = activate_url(ota_url)
    for _ in range(ACTIVATE_TRIES):
        try:
            status, _body = await post_json(url, headers, {})
        except (OSError, OtaError, ValueError) as error:
            log("ota: activation poll failed: " + str(error))
            status = 0
        if status == 200:
            log("ota: activated")
            return
        await asyncio.sleep(poll_s if status == 202 else retry_s)


# ---- firmware bundles ----------------------------------------------------------------------------


def _check_name(name):
    if not isinstance(name, str) or not name or name.startswith("/") or len(name) > 128:
        return False
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return False
    for char in name:
        if not (char.isalpha() or char.isdigit() or char in "_.-/"):
            return False
    return True


def _sha256():
    import hashlib

    return hashlib.sha256()


def _hex(digest):
    return hexlify(digest).decode()


def _makedirs(root, name):
    path = root
    for part in name.split("/")[:-1]:
        path = path + "/" + part
        try:
            os.mkdir(path)
        except OSError:  # exists already
            pass


class BundleWriter:
    """Fed the bundle in chunks; writes `<name>.new` files; `finish` checks and installs."""

    def __init__(self, root):
        self.root = root
        self.version = ""
        self.size = 0
        self._buffer = b""
        self._files = []
        self._have_header = False
        self._index = 0
        self._left = 0
        self._file = None
        self._digest = _sha256()
        self._total = _sha256()

    def feed(self, chunk):
        self._total.update(chunk)
        self.size += len(chunk)
        if not self._have_header:
            self._buffer += chunk
            if len(self._buffer) > MAX_ANSWER:
                raise OtaError("bundle header too large")
            if not self._read_header():
                return
            chunk, self._buffer = self._buffer, b""
        while chunk:
            file = self._file
            if file is None:
                file = self._open_next()
                if file is None:  # an empty file: already complete
                    continue
            take = chunk[: self._left]
            chunk = chunk[len(take) :]
            file.write(take)
            self._digest.update(take)
            self._left -= len(take)
            if self._left == 0:
                self._close_current()

    def _read_header(self):
        first = self._buffer.find(b"\n")
        second = self._buffer.find(b"\n", first + 1) if first >= 0 else -1
        if second < 0:
            return False
        if self._buffer[: first + 1] != BUNDLE_MAGIC:
            raise OtaError("not a firmware bundle")
        manifest = json.loads(self._buffer[first + 1 : second])
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, list) or not files:
            raise OtaError("bundle manifest has no files")
        for entry in files:
            if not isinstance(entry, list) or len(entry) != 3 or not _check_name(entry[0]):
                raise OtaError("bad bundle entry " + repr(entry)[:80])
        version = manifest.get("version")
        if version_tuple(version) is None:
            raise OtaError("bundle without a valid version")
        self.version = str(version)
        self._files = files
        self._have_header = True
        self._buffer = self._buffer[second + 1 :]
        return True

    def _open_next(self):
        """Start the next file; returns it open, or None when it is empty (done already)."""
        if self._index >= len(self._files):
            raise OtaError("bundle longer than its manifest says")
        name, size, _digest = self._files[self._index]
        _makedirs(self.root, name)
        file = open(self.root + "/" + name + ".new", "wb")
        self._file = file
        self._digest = _sha256()
        self._left = size
        if size == 0:
            self._close_current()
            return None
        return file

    def _close_current(self):
        name, _size, digest = self._files[self._index]
        file = self._file
        if file is not None:
            file.close()
        self._file = None
        if _hex(self._digest.digest()) != digest:
            raise OtaError("bundle file " + name + " does not match its SHA-256")
        self._index += 1

    def finish(self, sha256=None):
        """Check the whole bundle, then install its files and its version; returns it."""
        if not self._have_header or self._index != len(self._files) or self._file is not None:
            raise OtaError("bundle ended early")
        if sha256 and _hex(self._total.digest()) != sha256:
            raise OtaError("the bundle does not match the SHA-256 of the OTA answer")
        for name, _size, _digest in self._files:
            target = self.root + "/" + name
            try:
                os.remove(target)
            except OSError:
                pass
            os.rename(target + ".new", target)
        with open(self.root + "/" + VERSION_FILE, "w") as file:
            file.write(self.version)
        return self.version

    def discard(self):
        file = self._file
        if file is not None:
            file.close()
        self._file = None
        for entry in self._files:
            try:
                os.remove(self.root + "/" + entry[0] + ".new")
            except OSError:
                pass


async def apply_bundle(url, root, sha256=None, log=print):
    """Download and install a bundle into `root`; returns its version. Nothing is replaced
    unless every file and the whole bundle check out."""
    writer = BundleWriter(root)
    try:
        status, _ = await http_request("GET", url, {}, sink=writer.feed, timeout_s=60)
        if status != 200:
            raise OtaError("firmware download answered HTTP " + str(status))
        version = writer.finish(sha256)
    except BaseException:
        writer.discard()
        raise
    log("ota: installed firmware " + version + " (" + str(writer.size) + " bytes)")
    return version


def stored_version(root, default):
    """The version a bundle installed in `root`, else `default`."""
    try:
        with open(root + "/" + VERSION_FILE) as file:
            text = file.read().strip()
    except OSError:
        return default
    return text if version_tuple(text) is not None else default
